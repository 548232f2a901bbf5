"""The training loop on a tiny random Llama: it learns, checkpoints resume exactly, bad input is a clear error."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from agent_mtp.engine.cost import CostCurve
from agent_mtp.engine.loading import LoadedModel
from agent_mtp.errors import TrainingError
from agent_mtp.training.data import Record, _greedy_batch
from agent_mtp.training.evaluate import EvalPrompt, draft_tokens_per_forward, evaluate
from agent_mtp.training.objective import ObjectiveConfig
from agent_mtp.training.trainer import TrainConfig, Trainer, sample_sequence
from tests.unit.test_training_objective import MASK, VOCAB, tiny_model

EOS = 62


def tiny_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"t{EOS}", pad_token="t0")


def tiny_loaded(model: torch.nn.Module) -> LoadedModel:
    return LoadedModel(model, tiny_tokenizer(), "tiny", f"t{MASK}", MASK, mask_token_added=False)


def own_outputs(model: torch.nn.Module, n: int, length: int = 40, seed: int = 0) -> list[Record]:
    """The tiny model's own greedy continuations of random prompts (its teacher data)."""
    model.generation_config.eos_token_id = EOS
    model.config.eos_token_id = EOS
    gen = torch.Generator().manual_seed(seed)
    # two prompt endings: continuations differ per prompt but share structure, so a small adapter can learn them
    prompts = [[*torch.randint(3, 60, (5,), generator=gen).tolist(), 7 + 2 * (i % 2)] for i in range(n)]
    responses = _greedy_batch(model, prompts, 0, [EOS], length)
    return [
        Record(f"r{i}", "agent", "list", "heldout" if i < 3 else "train", p, r)
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True))
    ]


def make_trainer(model: torch.nn.Module, records: list[Record], out: Path, **changes: Any) -> Trainer:
    settings: dict[str, Any] = {
        "rank": 8,
        "objective": ObjectiveConfig(k_max=4),
        "steps": 80,
        "lr": 3e-2,
        "warmup": 2,
        "regions": 24,
        "seq_len": 96,
        "eval_every": 0,
        "eval_prompts": 0,
        "checkpoint_minutes": 1e9,
    }
    cfg = TrainConfig(**{**settings, **changes})
    return Trainer(
        tiny_loaded(model),
        config=cfg,
        train=[r for r in records if r.split == "train"],
        heldout=[],
        out_dir=out,
        progress=False,
    )


def test_a_few_steps_raise_tokens_per_forward_on_own_outputs(tmp_path: Path) -> None:
    model = tiny_model(seed=11, layers=2)
    records = own_outputs(model, 12)
    trainer = make_trainer(model, records, tmp_path)
    heldout = [r for r in records if r.split == "heldout"]

    def tokens_per_forward() -> float:
        rates = [
            draft_tokens_per_forward(model, r.prompt_ids, r.response_ids[:24], mask_token_id=MASK, k=4) for r in heldout
        ]
        return sum(rates) / len(rates)

    before = tokens_per_forward()
    first = [trainer.train_step() for _ in range(5)]
    for _ in range(55):
        last = trainer.train_step()
    after = tokens_per_forward()
    assert after > before + 0.5, (before, after)
    assert float(last.loss.detach()) < float(first[0].loss.detach())
    # the engine's lossless mode still reproduces NTP exactly with the trained adapter
    metrics = evaluate(trainer.engine, [EvalPrompt("list", heldout[0].prompt_ids)], k_max=4, max_new_tokens=12)
    assert metrics["verified_exact"]
    # the figure measures the adapter, not the machine: the same whatever cost curve the engine measured
    prompts = [EvalPrompt("list", r.prompt_ids) for r in heldout]
    trainer.engine.set_cost_curve(CostCurve(((1, 1.0), (2, 8.0))))  # a machine where a 2-token pass costs 8x
    steep = evaluate(trainer.engine, prompts, k_max=4, max_new_tokens=16)
    trainer.engine.set_cost_curve(CostCurve.flat())
    flat = evaluate(trainer.engine, prompts, k_max=4, max_new_tokens=16)
    assert steep == flat and steep["tpf_verified"] > 1.0


def test_checkpoint_and_resume_give_the_same_state(tmp_path: Path) -> None:
    records = own_outputs(tiny_model(seed=12), 10)
    a = make_trainer(tiny_model(seed=12), records, tmp_path / "a")
    for _ in range(3):
        a.train_step()
    ckpt = a.save_checkpoint()
    for _ in range(2):
        a.train_step()
    b = make_trainer(tiny_model(seed=12), records, tmp_path / "b")
    b.resume(ckpt)
    assert b.state.step == 3
    for _ in range(2):
        b.train_step()
    assert a.state == b.state
    assert a.adapter is not None and b.adapter is not None
    for name, tensor in a.adapter.state_tensors().items():
        assert torch.equal(tensor, b.adapter.state_tensors()[name]), name
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[k]["exp_avg"], sb[k]["exp_avg"]) for k in sa)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # layer 2's inputs need no gradient: the point
def test_train_layers_update_only_those_layers_and_stop_the_backward(tmp_path: Path) -> None:
    model = tiny_model(seed=16, layers=3)
    records = own_outputs(model, 8)
    before = {k: v.clone() for k, v in make_trainer(model, records, tmp_path / "ref").adapter.state_tensors().items()}
    model = tiny_model(seed=16, layers=3)
    trainer = make_trainer(model, records, tmp_path / "a", train_layers=(2,), freeze_embedding_after=0)
    assert trainer.adapter is not None
    reached: list[str] = []  # decoder layers the backward pass runs through
    for i, layer in enumerate(trainer.step_model.model.layers):
        layer.register_full_backward_hook(lambda *_, i=i: reached.append(f"layer {i}"))
    for _ in range(2):
        trainer.train_step()
    assert reached and set(reached) == {"layer 2"}
    after = trainer.adapter.state_tensors()
    for name, tensor in after.items():
        changed = not torch.equal(tensor, before[name])
        assert changed == (".layers.2." in name), name  # the mask embedding is frozen from step 0 too
    with pytest.raises(TrainingError, match=r"train_layers has layers \[0\] without LoRA"):
        make_trainer(tiny_model(seed=16, layers=3), records, tmp_path / "b", layers=(1, 2), train_layers=(0, 2))


def test_resume_with_another_rank_is_a_clear_error(tmp_path: Path) -> None:
    records = own_outputs(tiny_model(seed=13), 6)
    a = make_trainer(tiny_model(seed=13), records, tmp_path / "a")
    ckpt = a.save_checkpoint()
    b = make_trainer(tiny_model(seed=13), records, tmp_path / "b", layers=(1,))
    with pytest.raises(TrainingError, match="--layers"):
        b.resume(ckpt)
    with pytest.raises(TrainingError, match="trainer_state"):
        b.resume(tmp_path)


def test_bad_config_is_a_clear_error(tmp_path: Path) -> None:
    records = own_outputs(tiny_model(seed=14), 6)
    with pytest.raises(TrainingError, match="k_max=1"):
        make_trainer(tiny_model(), records, tmp_path, objective=ObjectiveConfig(k_max=1))
    with pytest.raises(TrainingError, match="No training records"):
        make_trainer(tiny_model(), [r for r in records if r.split == "heldout"], tmp_path)


def test_sampled_sequences_are_a_function_of_the_step() -> None:
    records = own_outputs(tiny_model(seed=15), 8)
    cfg = TrainConfig(objective=ObjectiveConfig(k_max=4, k_sampling="random"), regions=10, seq_len=80)
    a, b = sample_sequence(records, 7, cfg), sample_sequence(records, 7, cfg)
    assert torch.equal(a.ids, b.ids) and a.regions == b.regions
    assert all(1 <= r.n_masks <= 3 for r in a.regions)
    # every anchor sits in a response: at or after the prompt's last token (prompts have 6 tokens here), and never
    # at the last token of its document
    for r in a.regions:
        assert int(a.positions[r.anchor]) >= 5
        assert r.anchor + 1 < a.n_real and int(a.doc_ids[r.anchor + 1]) == int(a.doc_ids[r.anchor])


def test_full_fine_tune_trainer_steps_and_exports(tmp_path: Path) -> None:
    model = tiny_model(seed=16)
    records = own_outputs(model, 6)
    teacher_before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = make_trainer(model, records, tmp_path, adapter="full", lr=1e-3)
    for _ in range(2):
        trainer.train_step()
    assert not torch.equal(model.model.embed_tokens.weight, teacher_before["model.embed_tokens.weight"])
    for k, v in trainer.teacher.state_dict().items():
        assert torch.equal(v, teacher_before[k]), k  # the frozen copy never moves
    out = trainer.save_checkpoint()
    assert (out / "config.json").is_file() and (out / "trainer_state.pt").is_file()


def test_real_pass_cache_trains_the_same_adapter_and_reports_its_reuse(tmp_path: Path) -> None:
    records = own_outputs(tiny_model(seed=14), 8)
    plain = make_trainer(tiny_model(seed=14), records, tmp_path / "plain", real_pass_cache=False, log_every=3)
    cached = Trainer(
        tiny_loaded(tiny_model(seed=14)),
        config=replace(plain.cfg, real_pass_cache=True),
        train=plain.train_records,
        heldout=[],
        out_dir=tmp_path / "cached",
        progress=False,
        real_pass_dir=tmp_path / "store",
    )
    assert plain.store is None and cached.store is not None
    for _ in range(6):
        plain.train_step()
        cached.train_step()
    assert plain.adapter is not None and cached.adapter is not None
    for name, tensor in plain.adapter.state_tensors().items():
        assert torch.allclose(tensor, cached.adapter.state_tensors()[name], atol=1e-5), name
    stats = cached.store.stats.as_dict()
    assert stats["computed"] == len(plain.train_records) and stats["reused"] > 0.5  # 5 records drawn many times
    assert len(list((tmp_path / "store").rglob("*.pt"))) == len(plain.train_records)
    cached._log_window([cached.train_step()], 1.0, None)
    row = (tmp_path / "cached" / "log.jsonl").read_text().splitlines()[-1]
    assert '"real_pass_cache"' in row
