"""The default model's README.md: data and licenses, hyper-parameters and measured figures, from the
model directory's train_config.json and the evaluation's figures."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _fmt(value: float | None, spec: str = ".3g") -> str:
    return "—" if value is None else format(value, spec)


def copy_licenses(model_dir: Path, sources: dict) -> dict[str, str]:
    """Copy each corpus source's license text beside the weights as licenses/LICENSE.<source>
    (the weights derive from that text, so its notice travels with them); returns {source: path
    relative to the model directory}. A file already there is kept when its source is not on
    this machine."""
    names = {}
    (model_dir / "licenses").mkdir(exist_ok=True)
    for name, source in sources.items():
        target = model_dir / "licenses" / f"LICENSE.{name}"
        if Path(source["license_file"]).is_file() and Path(source["license_file"]) != target:
            shutil.copyfile(source["license_file"], target)
        if not target.is_file():
            raise FileNotFoundError(f"{source['license_file']}: license text of {name} not found")
        names[name] = f"licenses/{target.name}"
    return names


def _command(args: dict) -> str:
    """The command that trained it; every option not shown was at its default
    (train_config.json records them all)."""
    if args.get("agent_data"):  # the GPU retrain (retrain.py), in one call or resumed over several
        command = (f"bash tools/default_model/gpu_retrain.sh --minutes {args['minutes']} "
                   f"--weight-decay {args['weight_decay']} --agent-share {args['agent_share']}")
        if args.get("arch", "sink") != "sink":
            command += f" --arch {args['arch']}"
        if args.get("lr", 2e-3) != 2e-3:
            command += f" --lr {args['lr']}"
        if args.get("state"):
            command += f" --state {args['state']} --work .retrain_state/work"
        return command
    budget = f"--minutes {args['minutes']}" if args["steps"] is None else f"--steps {args['steps']}"
    return f"python3 tools/default_model/train_default_model.py --out {args['out']} {budget}"


def write_readme(model_dir: Path, figures: dict) -> None:
    """Write ``model_dir``/README.md and copy the corpus' license texts beside it."""
    record = json.loads((model_dir / "train_config.json").read_text("utf-8"))
    arch, args, corpus = record["architecture"], record["args"], record["corpus"] or {}
    loss, sink, check = figures["loss"], figures["attention_sink"], figures["consistency"]
    licenses = copy_licenses(model_dir, corpus.get("sources", {}))
    env = record["environment"]
    sinks = sum(s > 2 * sink["uniform_share"] for s in sink["per_layer"])
    # The criterion: position 0 at >= 10x a uniform key's share.
    strong_layers = [i for i, s in enumerate(sink["position0_per_layer"])
                     if s >= 10 * sink["uniform_position0"]]
    strong = len(strong_layers)
    top = max(range(len(sink["position0_per_layer"])), key=sink["position0_per_layer"].__getitem__)
    bos = sink["position0_per_layer"][top]
    lines = [
        "# irminsul-default: a small DeepSeek-V2 (MLA + MoE) trained here",
        "",
        "The embedded default model of Irminsul: it lets `irminsul serve`, `bench` and `consistency` "
        "run with no model download. It is a real trained model (in-domain agent-format and "
        "code output, trained attention), not random weights, but far too small to be useful "
        "beyond that.",
        "",
        "## Architecture",
        "",
        f"DeepSeek-V2 form (`model_type: deepseek_v2`), {record['parameters']:,} parameters, "
        f"bf16 safetensors. hidden {arch['hidden_size']}, {arch['num_hidden_layers']} layers "
        f"(first {arch['first_k_dense_replace']} dense, intermediate {arch['intermediate_size']}; "
        f"then MoE: {arch['n_routed_experts']} routed experts, top-{arch['num_experts_per_tok']}, "
        f"{arch['n_shared_experts']} shared, expert width {arch['moe_intermediate_size']}), "
        f"{arch['num_attention_heads']} heads. MLA: kv_lora_rank {arch['kv_lora_rank']} : "
        f"qk_rope_head_dim {arch['qk_rope_head_dim']} (8 : 1, DeepSeek's 89% / 11% latent row "
        f"split), qk_nope {arch['qk_nope_head_dim']}, v {arch['v_head_dim']}, no q LoRA. Rope: "
        f"YaRN `{json.dumps(arch['rope'])}`, max_position_embeddings "
        f"{arch['max_position_embeddings']}. config.json is in the legacy `rope_theta` + "
        "`rope_scaling` form. Tokenizer: byte-level BPE trained here "
        f"({corpus.get('vocab_size', '?')} tokens) with role / end-of-message / tool special "
        "tokens and an incremental chat template (tool schemas after the system prompt).",
        "",
        "## Data and licenses",
        "",
    ]
    rows = [[name, s["what"], f"{s['license']} (`{licenses[name]}`)",
             f"{s['documents']}/{s['available_documents']}", f"{s['train_tokens']:,}",
             f"{s['val_tokens']:,}"]
            for name, s in corpus.get("sources", {}).items()]
    lines += _table(["source", "what", "license (text beside the weights)", "documents used",
                     "train tokens", "val tokens"], rows)
    passes = record.get("passes")
    if isinstance(passes, list):  # the retrain: [package corpus, agent renders]
        passes_text = (f"{passes[0]:.2f} passes over the package corpus, {passes[1]:.1f} over the "
                       f"agent renders ({100 * corpus['agent_share']:.0f}% of the windows)")
        most = max(passes)
    else:
        most = record["tokens_seen"] / corpus["train_tokens"]
        passes_text = f"{most:.1f} passes over the training split"
    refused = corpus.get("refused", [])
    lines += [
        "",
        "Agent logs re-send the whole history on every call, so each session's longest request is "
        "kept. Validation is held out by document (seeded). Packages: every distribution installed "
        "on the training machine whose license is on the allowlist of "
        "`tools/default_model/package_corpus.py` and whose license text it can ship"
        + (f" ({len(refused)} refused: "
           + ", ".join(f"{r['name']} ({r['reason']})" for r in refused) + ")" if refused else "")
        + "; built by `package_corpus.py` and `agent_corpus.py` on the training machine.",
        "",
        "## Training",
        "",
        f"`{_command(args)}`: {record['steps']:,} steps, {record['tokens_seen']:,} tokens "
        f"({passes_text}), {record['train_seconds']:.0f} s on one {env['device']} (torch "
        f"{env['torch']}, transformers {env['transformers']}, Python {env['python']}); batch "
        f"{args['batch']} x {args['seq_len']} tokens"
        + (", every window opening with BOS at a document start" if args.get("bos_windows") else "")
        + f", AdamW (β 0.9/0.95, weight decay {args['weight_decay']}), peak lr "
        f"{args['lr']}, {args['warmup']} warm-up steps, cosine to {args['min_lr_ratio']}x, clip "
        f"{args['clip']}, router balance loss x{args['balance_coef']}, bf16 autocast on CUDA, seed "
        f"{args['seed']}. Full record: train_config.json, train_log.txt. "
        + (f"Re-run exactly with `--steps {record['steps']}`."
           if record.get("planned_steps", record["steps"]) == record["steps"] else
           f"The schedule was planned for {record['planned_steps']:,} steps over "
           f"{record.get('calls', 1)} device calls; the last call's time ran out at step "
           f"{record['steps']:,}. Re-run the whole schedule with "
           f"`--steps {record['planned_steps']}`."),
        "",
        "## Figures",
        "",
        "Measured by `python3 tools/default_model/evaluate_default_model.py MODEL_DIR --data "
        "DATA --agent-data .retrain/agent` (DATA: the retrain's data/; CPU, "
        f"{figures['environment']['threads']} threads, torch {figures['environment']['torch']}, "
        f"transformers {figures['environment']['transformers']}, "
        f"{figures['environment']['seconds']:.0f} s); every figure is in eval.json.",
        "",
        f"- Validation loss {loss['val_loss']:.3f} nats/token (perplexity "
        f"{loss['val_perplexity']:.1f}) against a unigram baseline of {loss['unigram_loss']:.3f} "
        f"(perplexity {loss['unigram_perplexity']:.0f}); {loss['windows']} windows of "
        f"{loss['window_tokens']} tokens, CPU fp32."
        + (f" On the agent renders' validation split: {figures['agent_loss']['val_loss']:.3f} "
           f"(unigram {figures['agent_loss']['unigram_loss']:.3f})." if "agent_loss" in figures
           else "")
        + f" At the end of training (GPU, {args['seq_len']}-token windows): "
        f"{record['val_loss']:.3f}, against a final training loss of "
        f"{record['final_train_loss']:.3f}"
        + (f": the most repeated data was seen {most:.1f} times, so part of it is memorised."
           if most > 3 else "."),
        f"- Irminsul's runtime and transformers agree to {sink['max_logit_diff_vs_transformers']:.1e} "
        f"(largest fp32 logit difference on the {sink['prompt_tokens']}-token sink prompts; the "
        "summation order differs, so it grows with the prompt length).",
        f"- Attention sink: mass on key positions [0, 32) and on position 0 (the BOS token) from "
        f"queries at positions >= 1024 of {sink['prompts']} validation documents of "
        f"{sink['prompt_tokens']} tokens (uniform attention would give {sink['uniform_share']:.3f} "
        f"on [0, 32) and {sink['uniform_position0']:.4f} on position 0). {strong} of "
        f"{len(sink['per_layer'])} layers give position 0 at least 10x a uniform key's share "
        f"(layers {', '.join(map(str, strong_layers)) or 'none'}); layer {top} the most, "
        f"{bos / sink['uniform_position0']:.0f}x, {bos:.3f} of the mass. {sinks} of "
        f"{len(sink['per_layer'])} layers put more than twice the uniform share on [0, 32)."
        + (" This model has no strong attention sink: it attends mostly by content and locally."
           if strong == 0 else ""),
        "",
    ]
    lines += _table(["layer", *map(str, range(len(sink["per_layer"])))],
                    [["[0, 32)", *(f"{s:.3f}" for s in sink["per_layer"])],
                     ["position 0", *(f"{s:.4f}" for s in sink["position0_per_layer"])]])
    lines += [
        "",
        f"- Output consistency (`irminsul consistency`, {check['tokens']} tokens per request) on "
        f"`irminsul workload agent_meta` built from the shipped samples: {check['requests']} "
        f"requests, {check['requests_with_hits']} with PIC hits, "
        f"{100 * check['pic_token_fraction']:.1f}% of prompt tokens served by PIC.",
        "",
    ]
    lines += _table(["cache path (hit requests)", "KL(p_full‖p_x)", "argmax-match",
                     "first divergence"],
                    [[name, _fmt(check[f"kl_{p}"]), _fmt(check[f"argmax_{p}"], ".3f"),
                      _fmt(check[f"first_divergence_{p}"], ".2f")]
                     for p, name in (("pic", "PIC (δ-rotated)"), ("naive", "naive reuse"))])
    lines += ["", "## Greedy samples", ""]
    for sample in figures["samples"]:
        lines += [f"**{sample['kind']}** — prompt `{sample['prompt'][:80]!r}`:", "", "```text",
                  sample["output"].replace("```", "'''"), "```", ""]
    (model_dir / "README.md").write_text("\n".join(lines), "utf-8")
