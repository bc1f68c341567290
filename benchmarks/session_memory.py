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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--body", type=int, default=4096, help="shared body tokens")
    parser.add_argument("--header", type=int, default=250, help="per-agent header tokens")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args()
    torch.manual_seed(0)
    model = MLAModel(parse_config(SMALL)).eval()
    text = agent_tokens(SMALL["vocab_size"])
    body = text[:args.body]
    row_bytes = {"ckv": LAYERS * RANK * 2, "kr": LAYERS * ROPE * 2}
    print(f"body {args.body} tokens, header {args.header} tokens; bytes per session, "
          "V2-Lite rows (bf16)")
    print(f"{'sessions':>8} {'mode':>5} {'c_KV slots':>11} {'k_r slots':>10} "
          f"{'MB / session':>13} {'vs off':>7}")
    for n in args.sessions:
        per_session = {}
        for mode in ("off", "live"):
            engine = Engine(model, num_slots=(args.body + args.header + 8) * (n + 1), mode=mode)
            for i in range(n):
                start = args.body + i * args.header
                prompt = np.concatenate([text[start:start + args.header], body])
                engine.prefill(prompt, [args.header])  # held: the sessions stay live
            used = {space: int((slots.refs > 0).sum()) for space, slots in
                    (("ckv", engine.pool.ckv_slots), ("kr", engine.pool.kr_slots))}
            per_session[mode] = sum(used[s] * row_bytes[s] for s in used) / n / 2**20
            ratio = per_session[mode] / per_session["off"]
            print(f"{n:>8} {mode:>5} {used['ckv']:>11,} {used['kr']:>10,} "
                  f"{per_session[mode]:>13.1f} {ratio:>6.2f}x")


if __name__ == "__main__":
    main()
