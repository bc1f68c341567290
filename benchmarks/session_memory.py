"""KV memory per session when N concurrent sessions share position-shifted content (issue #5).

N agent sessions are live at once, each holding a prompt made of its own per-agent header (H
tokens) and the same body of real agent text. Exact-prefix caching (``off``) cannot share the body
(the prompts differ from token 0), so every session holds a full KV copy; live PIC shares the
body's c_KV slots and gives each session only its own k_r (11% of the row). The engine's own slot
reference counts are read after all N prompts are prefilled; bytes are for DeepSeek-V2-Lite rows
(27 layers, c_KV 512 + k_r 64 in bf16). Slot counts do not depend on the weights, so a small random
model with the same latent layout stands in for the real one.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from irminsul.engine import Engine
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


def session_bytes(sessions: list[int], body_tokens: int = 4096, header: int = 250,
                  device: str = "cpu") -> list[dict[str, float]]:
    """Per N: c_KV and k_r slots held and MB per session (V2-Lite rows) in ``off`` and ``live``
    mode after N sessions with their own headers and a shared body are prefilled and held."""
    torch.manual_seed(0)
    model = MLAModel(parse_config(SMALL)).to(device).eval()
    text = agent_tokens(SMALL["vocab_size"])
    body = text[:body_tokens]
    row_bytes = {"ckv": LAYERS * RANK * 2, "kr": LAYERS * ROPE * 2}
    rows = []
    for n in sessions:
        row: dict[str, float] = {"sessions": n, "body_tokens": body_tokens, "header_tokens": header}
        for mode in ("off", "live"):
            engine = Engine(model, num_slots=(body_tokens + header + 8) * (n + 1), mode=mode)
            for i in range(n):
                start = body_tokens + i * header
                prompt = np.concatenate([text[start:start + header], body])
                engine.prefill(prompt, [header])  # held: the sessions stay live
            used = {space: int((slots.refs > 0).sum()) for space, slots in
                    (("ckv", engine.pool.ckv_slots), ("kr", engine.pool.kr_slots))}
            row[f"{mode}_ckv_slots"], row[f"{mode}_kr_slots"] = used["ckv"], used["kr"]
            row[f"{mode}_mb_per_session"] = sum(used[s] * row_bytes[s] for s in used) / n / 2**20
        row["live_over_off"] = row["live_mb_per_session"] / row["off_mb_per_session"]
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--body", type=int, default=4096, help="shared body tokens")
    parser.add_argument("--header", type=int, default=250, help="per-agent header tokens")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 8, 32])
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


if __name__ == "__main__":
    main()
