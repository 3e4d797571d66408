"""The engines' own limits: vLLM's checks (VllmEngine.check builds vLLM's SamplingParams) name the field at
fault, and the simulated engine accepts exactly what vLLM accepts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from p2pnode.config import EngineConfig
from p2pnode.engine.base import EngineRejected, SamplingOptions
from p2pnode.engine.simulated.realtime import SIM_MAX_LOGPROBS, SimEngine
from p2pnode.engine.vllm_engine import VllmEngine

BASE = SamplingOptions(max_tokens=16, temperature=1.0, top_p=1.0, top_k=0)

#: (field, values around vLLM's bounds).
PROBES = [
    ("temperature", [0.0, 0.5, 2.0, 2.0001, 3.0, 100.0]),
    ("top_p", [1e-6, 0.5, 1.0, 1.5]),
    ("top_k", [-2, -1, 0, 1, 50]),
    ("presence_penalty", [-2.5, -2.0, 0.0, 2.0, 2.01]),
    ("frequency_penalty", [-3.0, -2.0, 1.0, 2.0, 2.5]),
    ("repetition_penalty", [-1.0, 0.0, 1e-3, 1.0, 5.0, float("inf")]),
    ("min_tokens", [0, 16, 17]),
    ("logprobs", [0, 1, SIM_MAX_LOGPROBS, SIM_MAX_LOGPROBS + 1]),
    ("min_p", [-0.1, 0.0, 0.5, 1.0, 1.01]),
]


def vllm_accepts(options: SamplingOptions, *, model_checks: bool = True) -> bool:
    """vLLM's own verdict: SamplingParams' checks, plus (``model_checks``) the model config's default max_logprobs
    (20)."""
    from vllm import SamplingParams

    try:
        SamplingParams(
            max_tokens=options.max_tokens, temperature=options.temperature, top_p=options.top_p, top_k=options.top_k,
            presence_penalty=options.presence_penalty, frequency_penalty=options.frequency_penalty,
            repetition_penalty=options.repetition_penalty, min_tokens=options.min_tokens, logprobs=options.logprobs,
            min_p=options.min_p,
        )
    except ValueError:
        return False
    except Exception as e:  # VLLMValidationError
        if type(e).__name__ != "VLLMValidationError":
            raise
        return False
    return not model_checks or options.logprobs is None or options.logprobs <= vllm_default_max_logprobs()


def vllm_default_max_logprobs() -> int:
    from vllm.config import ModelConfig

    [field] = [f for f in dataclasses.fields(ModelConfig) if f.name == "max_logprobs"]
    default = field.default
    return int(getattr(default, "default", default))  # a pydantic FieldInfo inside vLLM's config dataclass


@pytest.mark.parametrize(("field", "values"), PROBES)
def test_the_simulated_engine_accepts_exactly_what_vllm_accepts(field: str, values: list) -> None:
    sim = SimEngine()
    for value in values:
        options = dataclasses.replace(BASE, **{field: value})
        try:
            sim.check(options)
            sim_ok = True
        except EngineRejected as e:
            sim_ok = False
            assert e.field == field
        assert sim_ok == vllm_accepts(options), (field, value)


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", 2.5), ("top_p", 1.5), ("presence_penalty", 3.0), ("frequency_penalty", -3.0),
     ("repetition_penalty", 0.0), ("min_tokens", 17)],
)
def test_vllm_engine_names_the_field_vllm_refuses(field: str, value: float) -> None:
    engine = VllmEngine(EngineConfig(model=Path("unused")))  # not started: SamplingParams' own checks only
    with pytest.raises(EngineRejected) as err:
        engine.check(dataclasses.replace(BASE, **{field: value}))
    assert err.value.field == field
    assert not err.value.message.startswith(field)  # "must be ...", the field named once by whoever prefixes it


def test_the_simulated_engine_mirrors_vllms_default_max_logprobs() -> None:
    assert vllm_default_max_logprobs() == SIM_MAX_LOGPROBS


@pytest.mark.parametrize(("field", "values"), PROBES)
def test_vllm_engines_check_gives_vllms_verdict(field: str, values: list) -> None:
    """vLLM's verdict on what the engine would submit (a top_k of 0 or less is submitted as 0, "disabled": the node's
    validation refuses one below -1 before any engine sees it). Not started, the engine runs SamplingParams' checks
    only (the model's, e.g. max_logprobs, need its config)."""
    engine = VllmEngine(EngineConfig(model=Path("unused")))
    verdicts, expected = [], []
    for value in values:
        options = dataclasses.replace(BASE, **{field: value})
        try:
            engine.check(options)
            verdicts.append(True)
        except EngineRejected as e:
            assert e.field == field
            verdicts.append(False)
        submitted = dataclasses.replace(options, top_k=max(options.top_k, 0))
        expected.append(vllm_accepts(submitted, model_checks=False))
    assert verdicts == expected
    assert True in verdicts  # every probe has values inside the bounds


def test_vllm_engine_accepts_values_on_the_bounds_and_passes_them_to_vllm() -> None:
    engine = VllmEngine(EngineConfig(model=Path("unused")))
    options = dataclasses.replace(BASE, temperature=2.0, presence_penalty=-2.0, repetition_penalty=1.3, min_tokens=16,
                                  logprobs=5)
    engine.check(options)  # raises EngineRejected if refused
    params = engine._sampling_params(options)  # what the engine submits to vLLM
    assert (params.temperature, params.presence_penalty, params.repetition_penalty, params.min_tokens,
            params.logprobs, params.max_tokens) == (2.0, -2.0, 1.3, 16, 5, 16)


def test_a_request_vllm_finished_with_an_error_is_a_failure_not_a_stop() -> None:
    """vLLM finishes a request with "error" when its core cannot compile the request's grammar, fails to preprocess
    it, or fails a KV load: that was mapped to STOP, a successful empty completion (vLLM's server answers 500)."""
    from types import SimpleNamespace

    from p2pnode.engine.base import EngineRequestFailed, FinishReason, SegmentOutcome
    from p2pnode.engine.vllm_engine import _Outputs
    from p2pnode.request import SamplingOptions

    options = SamplingOptions(max_tokens=16, temperature=0.0, top_p=1.0, top_k=0)

    def finished(reason: str) -> SimpleNamespace:
        completion = SimpleNamespace(finish_reason=reason, token_ids=[], text="", stop_reason=None, logprobs=None)
        return SimpleNamespace(outputs=[completion], finished=True, metrics=None, num_cached_tokens=0,
                               kv_transfer_params=None, prompt_logprobs=None)

    with pytest.raises(EngineRequestFailed, match="finish reason 'error'"):
        _Outputs(None, options, [1, 2, 3], None, None, SegmentOutcome()).chunk(finished("error"))
    for reason, expected in (("repetition", FinishReason.STOP), ("length", FinishReason.LENGTH)):
        chunk = _Outputs(None, options, [1, 2, 3], None, None, SegmentOutcome()).chunk(finished(reason))
        assert chunk.finish_reason is expected
