"""Tiny random-weight models and a tiny trained tokenizer, built in seconds for unit tests."""

from __future__ import annotations

import functools
from typing import Any

import torch

CORPUS = [
    'The quick brown fox jumps over the lazy dog. {"name": "get_weather", "arguments": {"city": "Paris"}}',
    "Thought: I should call a tool. Action: search. Observation: 42 results. Final answer: done.",
    "- item one\n- item two\n- item three\n| a | b |\n|---|---|\n| 1 | 2 |",
    "Summarise the text: agents copy names, ids and tool results all the time.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ ,.;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`",
]
EOS = "<|im_end|>"
BOS = "<|im_start|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return str(tok.to_str())


def tiny_tokenizer() -> Any:
    """A byte-level BPE tokenizer (~320 tokens) with a ChatML template; eos = <|im_end|>."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        eos_token=EOS,
        bos_token=BOS,
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_llama(
    vocab_size: int, *, seed: int = 0, layers: int = 2, hidden: int = 64, tie: bool = True, max_positions: int = 256
) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie,
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=0,
        initializer_range=0.2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.requires_grad_(False)
    return model


def tiny_engine(
    *,
    seed: int = 0,
    adapter: bool = False,
    adapter_seed: int = 1,
    tokenizer: Any = None,
    model_id: str = "tiny",
    **model_kwargs: Any,
) -> Any:
    """An MTPEngine over a tiny random model (the tiny BPE tokenizer unless ``tokenizer`` is given); with
    ``adapter=True`` a random (non-identity) gated adapter, so mask predictions differ from NTP."""
    from agent_mtp.engine import MTPEngine, new_adapter
    from agent_mtp.engine.loading import LoadedModel, ensure_mask_token

    tok = tokenizer if tokenizer is not None else tiny_tokenizer()
    model = tiny_llama(len(tok), seed=seed, **model_kwargs)
    mask, mask_id, _ = ensure_mask_token(model, tok, None)
    mtp = None
    if adapter:
        mtp = new_adapter(model, base_model="tiny", mask_token=mask, mask_token_id=mask_id, rank=4)
        gen = torch.Generator().manual_seed(adapter_seed)
        with torch.no_grad():
            for p in mtp.trainable_parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        mtp.requires_grad_(False)
    return MTPEngine(LoadedModel(model, tok, model_id, mask, mask_id, mask_token_added=True), adapter=mtp)
