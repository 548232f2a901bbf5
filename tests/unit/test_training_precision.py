"""The bf16 training twin: shared fp32 master parameters, exact-precision targets, a student close to fp32."""

from __future__ import annotations

import torch

from agent_mtp.training.objective import ObjectiveConfig, distill_gated
from agent_mtp.training.packing import Region, pack_documents
from agent_mtp.training.precision import low_precision_twin
from tests.unit.test_training_objective import MASK, tiny_adapter, tiny_model


def _seq() -> object:
    return pack_documents([[5, 9, 14, 3, 22, 7, 11, 40], [2, 8, 33, 17]], [Region(2, 3), Region(5, 2), Region(9, 3)])


def test_twin_shares_the_adapter_parameters_and_keeps_the_fp32_model() -> None:
    model = tiny_model(seed=21)
    adapter = tiny_adapter(model, seed=22)
    twin, twin_adapter = low_precision_twin(model, adapter, mask_token_id=MASK)
    assert twin.model.layers[0].mlp.up_proj.base.weight.dtype == torch.bfloat16
    assert model.model.layers[0].mlp.up_proj.base.weight.dtype == torch.float32
    mine = {id(p) for p in adapter.trainable_parameters()}
    assert {id(p) for p in twin_adapter.trainable_parameters()} == mine
    assert all(p.dtype == torch.float32 for p in twin_adapter.trainable_parameters())
    ids = torch.tensor([[5, 9, 14, MASK, MASK]])
    with torch.no_grad():
        exact = model(input_ids=ids).logits
        low = twin(input_ids=ids).logits
    assert low.dtype == torch.float32  # targets: fp32 head
    torch.testing.assert_close(low, exact, atol=0.1, rtol=0.05)


def test_a_twin_step_trains_the_fp32_adapter() -> None:
    model = tiny_model(seed=23)
    adapter = tiny_adapter(model, seed=24)
    twin, twin_adapter = low_precision_twin(model, adapter, mask_token_id=MASK)
    cfg = ObjectiveConfig(k_max=4)
    fp32 = distill_gated(model, adapter, _seq(), cfg, mask_token_id=MASK)  # type: ignore[arg-type]
    low = distill_gated(twin, twin_adapter, _seq(), cfg, mask_token_id=MASK)  # type: ignore[arg-type]
    assert abs(float(low.loss.detach()) - float(fp32.loss.detach())) < 0.05 * float(fp32.loss.detach())
    low.loss.backward()
    grads = [p.grad for p in adapter.trainable_parameters()]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)
    assert any(float(g.abs().sum()) > 0 for g in grads if g is not None)
    before = model(input_ids=torch.tensor([[5, 9, MASK]])).logits.detach()
    torch.optim.SGD(adapter.trainable_parameters(), lr=1.0).step()
    after = model(input_ids=torch.tensor([[5, 9, MASK]])).logits.detach()
    assert not torch.equal(before[0, -1], after[0, -1])  # the fp32 model runs the updated shared weights
    torch.testing.assert_close(before[0, :2], after[0, :2])  # real positions stay the base model's
