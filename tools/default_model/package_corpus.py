"""Build the retrain corpus from the installed Python packages and the standard library.

Runs on the machine that trains (no network, nothing carried but the repository): it walks every
site-packages directory of the running interpreter and its standard library, keeps only the
distributions whose license (dist-info METADATA: ``License-Expression``, else the ``License ::``
classifiers, else the ``License`` field) is permissive (ALLOWED), and tokenizes their text and code
(*.py, *.pyi, *.pyx, *.pxd, *.md, *.rst, *.txt; C/C++ of C_SOURCES) with the
EXISTING default-model tokenizer, so the rest of the project (chat template, special tokens,
tests) does not change.

Files are skipped when vendored (a ``_vendor``-like directory: their license is not the
distribution's), generated or data-like (over ``MAX_FILE_BYTES``, very long lines, few letters),
undecodable, tiny, or an exact duplicate of a file already taken. Validation is held out by
document: a file goes to val when its content hash falls in the ``val_fraction`` bucket, so the
split does not depend on the machine's file order.

Output (the ``.train/`` layout ``train_default_model.py`` reads): ``train.bin`` / ``val.bin``
(uint16 ids, each document BOS ... EOS, back to back, train documents in a seeded shuffle),
``train.starts.npy`` / ``val.starts.npy``, ``train.counts.npy`` (unigram counts, for the evaluation's
baseline without shipping train.bin), ``licenses/LICENSE.<source>`` (every kept distribution's
license files, to ship beside the weights) and ``manifest.json`` (per source: name, version,
license, how decided, files, tokens).

Usage: ``python tools/default_model/package_corpus.py --out /tmp/corpus [--packages a,b] [--workers 16]``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import sysconfig
import time
from collections.abc import Iterable
from importlib import metadata
from multiprocessing import get_context
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "irminsul" / "default_model" / "tokenizer.json"
BOS, EOS = "<|bos|>", "<|eos|>"  # chat_format's; not imported so workers stay light
SUFFIXES = {".py", ".pyi", ".pyx", ".pxd", ".md", ".rst", ".txt"}
# C/C++ sources are taken only from distributions whose declared license covers their bundled
# headers (torch's License-Expression lists them); others (triton) ship CUDA's headers, whose
# license is not permissive.
C_SUFFIXES = {".h", ".hpp", ".cuh", ".c", ".cc", ".cpp", ".cu"}
C_SOURCES = {"torch", "numpy"}
# A vendored copy carries its upstream's license, not the distribution's: leave it out.
VENDORED = {"_vendor", "vendor", "vendored", "_vendored", "externals", "_externals", "third_party",
            "thirdparty", "_thirdparty", "extern", "_extern"}
SKIP_PARTS = {"__pycache__", "site-packages", "dist-packages"}
MAX_FILE_BYTES, MIN_FILE_BYTES = 1_000_000, 64
# SPDX identifiers of permissive licenses (attribution at most: the notices ship with the weights).
ALLOWED = {"MIT", "MIT-0", "BSD-2-Clause", "BSD-3-Clause", "BSD-3-Clause-Clear", "0BSD", "BSD",
           "Apache-2.0", "PSF-2.0", "Python-2.0", "ISC", "Zlib", "HPND", "CC0-1.0", "Unlicense",
           "BSL-1.0", "MIT-CMU", "NCSA", "X11", "CNRI-Python"}
CLASSIFIERS = {
    "MIT License": "MIT", "MIT No Attribution License (MIT-0)": "MIT-0",
    "BSD License": "BSD", "Apache Software License": "Apache-2.0",
    "Python Software Foundation License": "PSF-2.0", "ISC License (ISCL)": "ISC",
    "zlib/libpng License": "Zlib", "The Unlicense (Unlicense)": "Unlicense",
    "Historical Permission Notice and Disclaimer (HPND)": "HPND",
    "Boost Software License 1.0 (BSL-1.0)": "BSL-1.0",
    "University of Illinois/NCSA Open Source License": "NCSA",
}
# Free-text ``License:`` values seen in the wild, lower-cased, punctuation-free.
LICENSE_WORDS = {
    "mit": "MIT", "mit license": "MIT", "the mit license": "MIT", "expat": "MIT",
    "bsd": "BSD", "bsd license": "BSD", "new bsd": "BSD-3-Clause", "new bsd license": "BSD-3-Clause",
    "3clause bsd": "BSD-3-Clause", "bsd3clause": "BSD-3-Clause", "bsd 3clause": "BSD-3-Clause",
    "bsd 3clause license": "BSD-3-Clause", "modified bsd": "BSD-3-Clause",
    "bsd2clause": "BSD-2-Clause", "simplified bsd": "BSD-2-Clause", "apache": "Apache-2.0",
    "apache 20": "Apache-2.0", "apache20": "Apache-2.0", "apache license 20": "Apache-2.0",
    "apache license version 20": "Apache-2.0", "apache software license": "Apache-2.0",
    "apache 2": "Apache-2.0", "apache 20 license": "Apache-2.0", "apache license": "Apache-2.0",
    "apache license v20": "Apache-2.0", "psf": "PSF-2.0",
    "psf license": "PSF-2.0", "python software foundation license": "PSF-2.0", "isc": "ISC",
    "isc license": "ISC", "unlicense": "Unlicense", "zlib": "Zlib", "hpnd": "HPND",
}
# First-lines fingerprints of a full license text pasted into ``License:``.
LICENSE_TEXTS = [("Permission is hereby granted, free of charge", "MIT"),
                 ("Redistribution and use in source and binary forms", "BSD"),
                 ("Apache License", "Apache-2.0")]
LICENSE_FILE = re.compile(r"^(LICEN[CS]E|COPYING|NOTICE|COPYRIGHT|AUTHORS|EULA)", re.IGNORECASE)


def spdx_allowed(expression: str) -> bool:
    """Whether an SPDX expression is satisfiable with ALLOWED licenses: some OR-alternative whose
    AND-terms are all allowed (parentheses flattened, ``WITH`` exceptions ignored: they only add
    permissions)."""
    expression = re.sub(r"\s+WITH\s+[\w.+-]+", "", expression.replace("(", " ").replace(")", " "))
    return any(all(term.strip().removesuffix("+") in ALLOWED for term in alt.split(" AND "))
               for alt in re.split(r"\s+OR\s+", expression.strip()))


def classify(meta: metadata.PackageMetadata) -> tuple[str | None, str]:
    """(license, how it was decided); license is None when it is not known to be permissive."""
    expression = meta.get("License-Expression")
    if expression:
        return (expression if spdx_allowed(expression) else None), "License-Expression"
    found = [c.split("::")[-1].strip() for c in meta.get_all("Classifier") or []
             if c.startswith("License ::") and c.count("::") >= 2]
    specific = [c for c in found if c != "OSI Approved"]
    if specific:
        # No AND/OR is recorded in classifiers: every listed license must be permissive.
        ids = [CLASSIFIERS.get(c) for c in specific]
        return (" AND ".join(sorted(set(ids))) if all(ids) else None), "classifiers"
    text = (meta.get("License") or "").strip()
    key = re.sub(r"[^a-z0-9 ]", "", text.lower())
    if key in LICENSE_WORDS:
        return LICENSE_WORDS[key], "License field"
    head = text[:2000]
    for fingerprint, spdx in LICENSE_TEXTS:
        if fingerprint in head:
            return spdx, "License field (full text)"
    return None, "unknown"


def license_text(dist: metadata.Distribution) -> str:
    """The distribution's license files (dist-info ``License-File`` / ``licenses/`` / LICENSE*),
    concatenated; else a long ``License`` field; else ''."""
    paths = []
    for entry in dist.files or []:
        parts = Path(str(entry)).parts
        if parts and parts[0].endswith(".dist-info") and LICENSE_FILE.match(parts[-1]):
            paths.append(Path(str(dist.locate_file(entry))))
        elif len(parts) > 1 and parts[0].endswith(".dist-info") and parts[1] == "licenses":
            paths.append(Path(str(dist.locate_file(entry))))
    chunks = []
    for path in sorted(set(paths)):
        if path.is_file():
            chunks.append(f"==== {path.name} ====\n" + path.read_text("utf-8", errors="replace"))
    if chunks:
        return "\n\n".join(chunks)
    text = dist.metadata.get("License") or ""
    return text if len(text) > 200 else ""


def wanted(path: Path, c_sources: bool = False) -> bool:
    """Text or code file, not vendored, not a license text (repeated boilerplate), not in a
    dist-info or cache directory."""
    parts = set(path.parts)
    suffixes = SUFFIXES | C_SUFFIXES if c_sources else SUFFIXES
    return (path.suffix in suffixes and not (VENDORED | SKIP_PARTS) & parts
            and not LICENSE_FILE.match(path.name)
            and not any(p.endswith((".dist-info", ".egg-info")) for p in path.parts))


def site_dirs() -> list[Path]:
    """The interpreter's site-packages directories (venv and system), existing, deduplicated."""
    import site

    dirs = [*site.getsitepackages(), site.getusersitepackages(),
            sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    seen: list[Path] = []
    for d in map(Path, dirs):
        if d.is_dir() and d.resolve() not in [s.resolve() for s in seen]:
            seen.append(d)
    return seen


def stdlib_source(stdlib: Path) -> dict:
    """The standard library as one source (PSF-2.0), with its license text."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    files = sorted(p for p in stdlib.rglob("*") if p.is_file() and wanted(p.relative_to(stdlib.parent)))
    shipped = ROOT / "irminsul" / "default_model" / "licenses" / "LICENSE.cpython-stdlib"
    candidates = [stdlib / "LICENSE.txt", Path(sys.base_prefix) / "share/doc" / f"python{version}" /
                  "copyright", shipped]
    text = next((p.read_text("utf-8", errors="replace") for p in candidates if p.is_file()), "")
    return {"name": "cpython-stdlib", "version": sys.version.split()[0], "license": "PSF-2.0",
            "decided_by": "CPython", "what": f"CPython {version} standard library ({stdlib})",
            "files": files, "license_text": text}


def package_sources(only: set[str] | None) -> tuple[list[dict], list[dict]]:
    """(kept, refused): one source per installed distribution; refused ones with the reason."""
    kept, refused, names = [], [], set()
    for directory in site_dirs():
        for dist in sorted(metadata.distributions(path=[str(directory)]),
                           key=lambda d: (d.metadata["Name"] or "").lower()):
            name = re.sub(r"[-_.]+", "-", (dist.metadata["Name"] or "").lower())
            if not name or name in names or (only and name not in only):
                continue
            names.add(name)
            spdx, how = classify(dist.metadata)
            record = {"name": name, "version": dist.version, "license": spdx, "decided_by": how}
            if spdx is None:
                refused.append({**record, "license_field": (dist.metadata.get("License") or "")[:80],
                                "reason": "license not in the allowlist"})
                continue
            text = license_text(dist)
            if not text:
                refused.append({**record, "reason": "no license text to ship"})
                continue
            files = sorted({Path(str(dist.locate_file(f))) for f in dist.files or []
                            if wanted(Path(str(f)), name in C_SOURCES)})
            kept.append({**record, "what": f"{name} {dist.version} (installed package)",
                         "files": [f for f in files if f.is_file()], "license_text": text})
    return kept, refused


_TOKENIZER = None


def _init_worker(path: str) -> None:
    global _TOKENIZER
    from tokenizers import Tokenizer

    _TOKENIZER = Tokenizer.from_file(path)


def data_like(text: str) -> bool:
    """Generated tables, minified or binary-ish text: long average lines or few letters."""
    lines = text.count("\n") + 1
    letters = sum(c.isalpha() or c.isspace() for c in text[:20000]) / max(1, min(len(text), 20000))
    return len(text) / lines > 160 or letters < 0.6


def encode_files(job: tuple[int, list[str]]) -> list[tuple[int, str, np.ndarray | None]]:
    """Worker: (source index, [paths]) -> [(source, content hash or skip reason, ids or None)]."""
    source, paths = job
    bos, eos = _TOKENIZER.token_to_id(BOS), _TOKENIZER.token_to_id(EOS)
    texts: list[str] = []
    out: list[tuple[str, bool]] = []  # (hash or skip reason, kept)
    for path in paths:
        try:
            raw = Path(path).read_bytes()
        except OSError:
            out.append(("unreadable", False))
            continue
        if not MIN_FILE_BYTES <= len(raw) <= MAX_FILE_BYTES:
            out.append(("size", False))
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            out.append(("not utf-8", False))
            continue
        if data_like(text):
            out.append(("data-like", False))
            continue
        out.append((hashlib.blake2b(raw, digest_size=16).hexdigest(), True))
        texts.append(text)
    # encode_batch_fast (tokenizers >= 0.21) skips the offsets, which are not needed here.
    encode = getattr(_TOKENIZER, "encode_batch_fast", _TOKENIZER.encode_batch)
    encodings = iter(encode(texts, add_special_tokens=False))
    return [(source, key, np.asarray([bos, *next(encodings).ids, eos], dtype=np.uint16) if kept
             else None) for key, kept in out]


def jobs(sources: list[dict], per_job: int) -> Iterable[tuple[int, list[str]]]:
    """Small batches of one source's files, so 16 workers stay busy to the end."""
    for i, source in enumerate(sources):
        files = [str(f) for f in source["files"]]
        for k in range(0, len(files), per_job):
            yield i, files[k:k + per_job]


def write_split(out: Path, name: str, docs: list[np.ndarray]) -> int:
    """``name``.bin (tokens back to back) and ``name``.starts.npy; returns the token count."""
    tokens = np.concatenate(docs) if docs else np.zeros(0, np.uint16)
    tokens.tofile(out / f"{name}.bin")
    np.save(out / f"{name}.starts.npy", np.cumsum([0] + [d.size for d in docs[:-1]]).astype(np.int64))
    return int(tokens.size)


def build(out: Path, *, only: set[str] | None, stdlib: bool, workers: int, val_fraction: float,
          max_tokens: int | None, seed: int, log=print) -> dict:
    """Build the corpus into ``out``; returns the manifest (also written there)."""
    started = time.time()
    out.mkdir(parents=True, exist_ok=True)
    (out / "licenses").mkdir(exist_ok=True)
    sources, refused = package_sources(only)
    if stdlib:
        sources.insert(0, stdlib_source(Path(sysconfig.get_paths()["stdlib"])))
    log(f"corpus: {len(sources)} sources allowed, {len(refused)} refused, "
        f"{sum(len(s['files']) for s in sources):,} candidate files ({time.time() - started:.1f}s)")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core instead
    seen: set[str] = set()
    train: list[np.ndarray] = []
    val: list[np.ndarray] = []
    stats = [{"documents": 0, "available_documents": len(s["files"]), "train_tokens": 0,
              "val_tokens": 0, "skipped": {}} for s in sources]
    bucket = int(val_fraction * 10_000)
    # spawn, not fork: the caller (retrain.py) has imported torch and may have touched CUDA.
    with get_context("spawn").Pool(workers, _init_worker, (str(TOKENIZER),)) as pool:
        for results in pool.imap(encode_files, jobs(sources, 32), chunksize=1):
            for s, key, ids in results:
                if ids is None or key in seen:
                    reason = "duplicate" if ids is not None else key
                    stats[s]["skipped"][reason] = stats[s]["skipped"].get(reason, 0) + 1
                    continue
                seen.add(key)
                stats[s]["documents"] += 1
                if int(key[:8], 16) % 10_000 < bucket:
                    val.append(ids)
                    stats[s]["val_tokens"] += int(ids.size)
                else:
                    train.append(ids)
                    stats[s]["train_tokens"] += int(ids.size)
    log(f"corpus: tokenized {len(train) + len(val):,} documents in {time.time() - started:.1f}s")
    np.random.default_rng(seed).shuffle(train)  # packages interleave in every training window
    if max_tokens:
        sizes = np.cumsum([d.size for d in train])
        train = train[:int(np.searchsorted(sizes, max_tokens, side="right"))]
    manifest_sources = {}
    for source, stat in zip(sources, stats):
        if not stat["documents"]:
            continue
        license_file = out / "licenses" / f"LICENSE.{source['name']}"
        license_file.write_text(source["license_text"], "utf-8")
        manifest_sources[source["name"]] = {
            "what": source["what"], "version": source["version"], "license": source["license"],
            "license_decided_by": source["decided_by"], "license_file": str(license_file), **stat}
    train_tokens = write_split(out, "train", train)
    counts = np.bincount(np.concatenate(train) if train else np.zeros(0, np.int64), minlength=65536)
    np.save(out / "train.counts.npy", counts.astype(np.int64))
    manifest = {
        "seed": seed, "val_fraction": val_fraction, "max_tokens": max_tokens,
        "tokenizer": str(TOKENIZER.relative_to(ROOT)), "train_tokens": train_tokens,
        "val_tokens": write_split(out, "val", val), "train_documents": len(train),
        "val_documents": len(val), "python": sys.version.split()[0],
        "site_dirs": [str(d) for d in site_dirs()], "sources": manifest_sources,
        "refused": refused, "seconds": round(time.time() - started, 1),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1), "utf-8")
    log(f"corpus: {train_tokens:,} train + {manifest['val_tokens']:,} val tokens from "
        f"{len(manifest_sources)} sources in {manifest['seconds']}s")
    return manifest


def summary(manifest: dict) -> str:
    """One line per source, largest first: tokens, documents, license."""
    rows = sorted(manifest["sources"].items(), key=lambda kv: -kv[1]["train_tokens"])
    lines = [f"{name:28} {s['version']:>14} {s['train_tokens'] + s['val_tokens']:>13,} tokens "
             f"{s['documents']:>6,} docs  {s['license']}" for name, s in rows]
    lines += [f"refused: {r['name']} {r['version']} ({r['reason']}; {r.get('license_field', '')})"
              for r in manifest["refused"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """Command line: build into ``--out`` and print the per-source counts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--packages", help="comma-separated distribution names (default: all)")
    parser.add_argument("--no-stdlib", action="store_true")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--val-fraction", type=float, default=0.01)
    parser.add_argument("--max-tokens", type=int, help="cap on training tokens (smoke tests)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    only = ({re.sub(r"[-_.]+", "-", p.lower()) for p in args.packages.split(",")}
            if args.packages else None)
    manifest = build(args.out, only=only, stdlib=not args.no_stdlib, workers=args.workers,
                     val_fraction=args.val_fraction, max_tokens=args.max_tokens, seed=args.seed)
    print(summary(manifest))
    return manifest


if __name__ == "__main__":
    main()
