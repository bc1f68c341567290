"""KV memory per session when N concurrent sessions share position-shifted content.

The GPU suite's ``memory`` section; it counts slots, so it also runs alone on a CPU.

N agent sessions are live at once, each holding a prompt made of its own per-agent header (H
tokens) and the same body of real agent text. Exact-prefix caching (``off``) cannot share the body
(the prompts differ from token 0), so every session holds a full KV copy; live PIC shares the
body's c_KV slots and gives each session only its own k_r (11% of the row). The engine's own slot
reference counts are read after all N prompts are prefilled; bytes are for DeepSeek-V2-Lite rows
(27 layers, c_KV 512 + k_r 64 in bf16). Slot counts do not depend on the weights, so a small random
model with the same latent layout stands in for the real one.

What that buys at a fixed memory budget: how many such sessions a pool of B bytes holds at once,
with exact prefixes only, and live with k_r slot spaces of 1 (equal spaces), 4, 8, ... k_r slots
per c_KV slot — sessions are prefilled and held until the pool is exhausted.

    python benchmarks/gpu/session_memory.py [--sessions 1 8 32] [--budget-mb 1024] [--ratios 1 4 8 12 16]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from irminsul.config import EngineConfig
from irminsul.engine import Engine, PoolExhausted
from irminsul.model import MLAModel, parse_config
from irminsul.traffic.logs import sample_logs
from irminsul.traffic.prompt import message_tokens
from irminsul.traffic.render import ChatRenderer

LAYERS, RANK, ROPE = 27, 512, 64  # DeepSeek-V2-Lite's latent row
SMALL = dict(model_type="deepseek_v2", vocab_size=4096, hidden_size=64, num_hidden_layers=1,
             num_attention_heads=2, kv_lora_rank=RANK, qk_nope_head_dim=16, qk_rope_head_dim=ROPE,
             v_head_dim=16, intermediate_size=64, max_position_embeddings=163840,
             rope_theta=10000)


def agent_tokens(vocab: int) -> np.ndarray:
    """Real agent tokens (distinct messages of the shipped tau-bench sample), folded into the
    small stand-in model's vocabulary."""
    return message_tokens(ChatRenderer.default(), sample_logs()[:1]) % vocab


ROW_BYTES = {"ckv": LAYERS * RANK * 2, "kr": LAYERS * ROPE * 2}


def _stand_in(device: str) -> tuple[MLAModel, np.ndarray]:
    """The small model with V2-Lite's latent layout, and the agent text the sessions are cut
    from (a session's header is text after the body, its own for each session)."""
    torch.manual_seed(0)
    return (MLAModel(parse_config(SMALL)).to(device).eval(),
            agent_tokens(SMALL["vocab_size"]))


def _session(text: np.ndarray, body_tokens: int, header: int, i: int) -> np.ndarray:
    start = body_tokens + i * header
    return np.concatenate([text[start:start + header], text[:body_tokens]])


def session_bytes(sessions: list[int], body_tokens: int = 4096, header: int = 250,
                  device: str = "cpu") -> list[dict[str, float]]:
    """Per N: c_KV and k_r slots held and MB per session (V2-Lite rows) in ``off`` and ``live``
    mode after N sessions with their own headers and a shared body are prefilled and held."""
    model, text = _stand_in(device)
    rows = []
    for n in sessions:
        row: dict[str, float] = {"sessions": n, "body_tokens": body_tokens, "header_tokens": header}
        for mode in ("off", "live"):
            engine = Engine(model, EngineConfig(slots=(body_tokens + header + 8) * (n + 1), mode=mode))
            for i in range(n):
                engine.prefill(_session(text, body_tokens, header, i), [header])  # held: live
            used = {space: int((slots.refs > 0).sum()) for space, slots in
                    (("ckv", engine.pool.ckv_slots), ("kr", engine.pool.kr_slots))}
            row[f"{mode}_ckv_slots"], row[f"{mode}_kr_slots"] = used["ckv"], used["kr"]
            row[f"{mode}_mb_per_session"] = sum(used[s] * ROW_BYTES[s] for s in used) / n / 2**20
        row["live_over_off"] = row["live_mb_per_session"] / row["off_mb_per_session"]
        rows.append(row)
    return rows


def sessions_held(budget_bytes: int, ratios: list[float], body_tokens: int = 4096,
                  header: int = 250, device: str = "cpu") -> list[dict[str, float]]:
    """Sessions (own header, shared body) a pool of ``budget_bytes`` of V2-Lite rows holds at
    once: exact prefixes only (``off``, one slot per token in each space), and ``live`` with
    each ratio of k_r slots to c_KV slots (1: equal spaces)."""
    model, text = _stand_in(device)
    rows = []
    for mode, ratio in [("off", 1.0)] + [("live", float(r)) for r in ratios]:
        ckv_slots = int(budget_bytes / (ROW_BYTES["ckv"] + ratio * ROW_BYTES["kr"]))
        engine = Engine(model, EngineConfig(slots=ckv_slots, kr_slots=int(ratio * ckv_slots), mode=mode))
        held = 0
        while (body_tokens + (held + 1) * header) <= text.size:
            try:
                engine.prefill(_session(text, body_tokens, header, held), [header])
            except PoolExhausted:
                break
            held += 1
        else:
            raise ValueError(f"the agent text ran out after {held} sessions; use a smaller budget")
        engine.check()
        rows.append({"mode": mode, "kr_per_ckv_slot": ratio, "ckv_slots": ckv_slots,
                     "kr_slots": int(ratio * ckv_slots), "sessions": held})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--body", type=int, default=4096, help="shared body tokens")
    parser.add_argument("--header", type=int, default=250, help="per-agent header tokens")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--budget-mb", type=float, default=1024,
                        help="KV memory of the sessions-held table (V2-Lite rows)")
    parser.add_argument("--ratios", type=float, nargs="+", default=[1, 4, 8, 12, 16],
                        help="k_r slots per c_KV slot for live mode")
    args = parser.parse_args()
    print(f"body {args.body} tokens, header {args.header} tokens; bytes per session, "
          "V2-Lite rows (bf16)")
    print(f"{'sessions':>8} {'mode':>5} {'c_KV slots':>11} {'k_r slots':>10} "
          f"{'MB / session':>13} {'vs off':>7}")
    for row in session_bytes(args.sessions, args.body, args.header):
        for mode in ("off", "live"):
            ratio = row[f"{mode}_mb_per_session"] / row["off_mb_per_session"]
            print(f"{row['sessions']:>8} {mode:>5} {row[f'{mode}_ckv_slots']:>11,} "
                  f"{row[f'{mode}_kr_slots']:>10,} {row[f'{mode}_mb_per_session']:>13.1f} "
                  f"{ratio:>6.2f}x")
    print(f"\nsessions held at once in {args.budget_mb:g} MB")
    print(f"{'mode':>5} {'k_r per c_KV slot':>18} {'c_KV slots':>11} {'k_r slots':>10} "
          f"{'sessions':>9}")
    for row in sessions_held(int(args.budget_mb * 2**20), args.ratios, args.body, args.header):
        print(f"{row['mode']:>5} {row['kr_per_ckv_slot']:>18g} {row['ckv_slots']:>11,} "
              f"{row['kr_slots']:>10,} {row['sessions']:>9}")


if __name__ == "__main__":
    main()
