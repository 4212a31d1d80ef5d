"""The fused int8 decoder (runtime/fused.py): when a model gets one, that it gives the model's own hidden states to
the bit on padded batches of several rows, and that the engine runs it (engine/passes.py)."""

import random

import pytest
import torch
from test_int8 import ONEDNN_INT8, int8_model
from tiny import make_text

from slimroute.config import EngineConfig
from slimroute.engine.fast import Engine
from slimroute.engine.passes import FusedPasses, ModelPasses, passes_for
from slimroute.runtime.attention import NATIVE, set_attention
from slimroute.runtime.fused import Attend, fuse, fused_decoder
from slimroute.runtime.native import Tokens, native
from slimroute.task import Task

pytestmark = [pytest.mark.kernels, pytest.mark.skipif(native() is None, reason="slimroute's native kernels do not "
                                                      "build here (see the note logged by slimroute.runtime.native)")]
VARIANTS = ["qwen2", "llama", pytest.param("qwen2-onednn", marks=pytest.mark.skipif(
    bool(ONEDNN_INT8), reason=f"oneDNN's int8 kernel is not usable here: {ONEDNN_INT8}"))]


def _model(variant: str):
    arch, _, kernel = variant.partition("-")
    return int8_model(arch, kernel or "fbgemm")


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_fused_decoder_gives_every_hidden_state_of_the_models_own_forward_on_a_padded_batch(variant):
    """Rows of other lengths, right-padded, through the model's own forward (its modules, its attention marked
    native) and through the decoder on the same tokens packed: every layer's output and the final norm's, equal."""
    model, _ = _model(variant)
    decoder = fused_decoder(model)
    lengths = torch.tensor([9, 3, 17, 1])
    ids = torch.randint(3, model.config.vocab_size, (4, 17), generator=torch.Generator().manual_seed(1))
    mask = torch.arange(17) < lengths[:, None]
    with torch.inference_mode():
        own = model.get_decoder()(input_ids=ids, attention_mask=mask.long(), use_cache=False,
                                  output_hidden_states=True)
        tokens = Tokens.of_lengths(lengths)
        attend = Attend(None, 0, decoder.new_keys(4, 17), tokens.steps + 1, torch.zeros(4, dtype=torch.int64))
        layers = tuple(range(len(decoder.layers) + 1))
        final, states = decoder.run(ids[mask], tokens.steps, tokens, attend, layers=layers)
        last, _ = decoder.run(ids[mask], tokens.steps, tokens, Attend(None, 0, decoder.new_keys(4, 17),
                              tokens.steps + 1, torch.zeros(4, dtype=torch.int64)), last=tokens.row_starts[1:] - 1)
    for k in layers:
        assert torch.equal(states[k], own.hidden_states[k][mask]), k
    assert torch.equal(final, own.last_hidden_state[mask])
    assert torch.equal(last, own.last_hidden_state[torch.arange(4), lengths - 1])  # the last layer on those alone


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_fused_model_runs_its_decoder_in_the_engine_and_its_attention_native_in_the_reference(variant):
    model, tok = _model(variant)
    assert all(getattr(layer.self_attn, NATIVE, None) is native() for layer in model.get_decoder().layers)
    engine = Engine(model, tok, Task(("Technical Support", "Technical Sales", "billing")), EngineConfig(batch_size=4))
    assert isinstance(engine.passes, FusedPasses) and engine.prefix.length > 0
    rng = random.Random(3)
    engine.classify([make_text(rng, n) for n in (2, 40, 7)])
    assert engine.last_stats.num_items == 3


def test_without_its_conditions_a_model_keeps_its_own_modules_and_says_why(monkeypatch):
    model, _ = int8_model("qwen2", fused=False)
    set_attention(model, "eager")
    assert fuse(model) == "the model's attention is not the batch-invariant kernel"
    set_attention(model)
    assert fuse(model) is None and fused_decoder(model) is not None
    set_attention(model, "invariant")  # set again: the decoder and the native marks go with the old setting
    assert fused_decoder(model) is None and not hasattr(model.get_decoder().layers[0].self_attn, NATIVE)
    assert isinstance(passes_for(model, [1, 2]), ModelPasses)
    import slimroute.runtime.fused as fused_module

    monkeypatch.setattr(fused_module, "native", lambda: None)
    assert fuse(model) == "slimroute's native kernels do not run here"
