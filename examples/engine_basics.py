"""The MTP engine on its own: lossless verified decoding vs plain NTP on an agent-like prompt.

Run:  .venv/bin/python examples/engine_basics.py
"""

from __future__ import annotations

from agent_mtp import DecodeConfig, MTPEngine

MESSAGES = [
    {"role": "system", "content": "Answer with one JSON object and nothing else."},
    {"role": "user", "content": "Return a JSON object with keys city and unit for: weather in Paris, celsius."},
]


def main(max_new_tokens: int = 48) -> None:
    engine = MTPEngine.from_pretrained("default")
    ntp = engine.generate(MESSAGES, DecodeConfig(mode="ntp", max_new_tokens=max_new_tokens))
    fast = engine.generate(MESSAGES, DecodeConfig(mode="verified", k_max=8, max_new_tokens=max_new_tokens))
    print("output:", fast.text)
    print("identical to NTP:", fast.token_ids == ntp.token_ids)
    for name, r in (("ntp", ntp), ("verified", fast)):
        s = r.stats
        print(
            f"{name:9s} {s.new_tokens:3d} tokens in {s.forward_passes:3d} passes "
            f"({s.tokens_per_forward:.2f} tokens/forward), {s.tokens_per_second:5.1f} tokens/s, drafts {s.draft_stats}"
        )


if __name__ == "__main__":
    main()
