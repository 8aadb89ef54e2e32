"""The randomized sweep (`omniattn check --sweep`): its draws are deterministic and accepted by
the API, its comparison fails wrong results, and the command runs end to end."""
from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

import omniattn
from omniattn import cli, sweep
from omniattn.reference import attention_reference

GPU = torch.cuda.is_available()
# tiny interpreter draws: the end-to-end tests stay within seconds
TINY = dataclasses.replace(sweep.INTERPRETER_LIMITS, head_dims=(16, 32), odd_head_dims=(24,),
                           max_heads=2, length_ranges=((1, 8), (1, 20)), block_sizes=(16, 32),
                           max_elements=1 << 11)


def test_config_seeds_are_deterministic_and_distinct():
    seeds = [sweep.config_seed(7, i) for i in range(500)]
    assert seeds == [sweep.config_seed(7, i) for i in range(500)]
    assert len(set(seeds)) == 500
    assert not set(seeds) & {sweep.config_seed(8, i) for i in range(500)}


@pytest.mark.parametrize("limits", [sweep.INTERPRETER_LIMITS, sweep.GPU_LIMITS],
                         ids=["interpreter", "gpu"])
def test_draws_are_deterministic_within_limits_and_cover_every_family(limits):
    configs = [sweep.draw_config(sweep.config_seed(3, i), limits) for i in range(200)]
    assert configs == [sweep.draw_config(sweep.config_seed(3, i), limits) for i in range(200)]
    families = collections.Counter(f for c in configs for f in c.families)
    expected = {"dense", "causal", "window", "mask", "bias", "mask+bias", "rows", "block",
                "varlen", "gqa", "softcap", "lse", "deterministic", "padded-dim", "fwd-only"}
    assert expected <= set(families), f"never drawn: {expected - set(families)}"
    for config in configs:
        assert config.dtype in limits.dtypes
        assert config.head_dim in limits.head_dims + limits.odd_head_dims
        assert config.heads % config.heads_k == 0 and config.heads <= limits.max_heads
        assert config.batch * config.heads * config.seqlen_q * config.seqlen_k \
            <= max(limits.max_elements, config.batch * config.seqlen_q * config.seqlen_k)
        if config.block is not None:
            assert all(size % 16 == 0 for size in config.block.block_size)
    builders = {c.block.builder for c in configs if c.block is not None}
    assert builders == set(sweep.BLOCK_BUILDERS)


@pytest.mark.parametrize("limits, count", [(sweep.INTERPRETER_LIMITS, 200),
                                           (sweep.GPU_LIMITS, 25)], ids=["interpreter", "gpu"])
def test_drawn_calls_pass_validation(limits, count):
    """Every drawn call is accepted by `attention`'s validation, and the same seed builds the
    same tensors. (GPU sizes built on the CPU: fewer of them.) `explain` validates as
    `attention` does (values of lengths and offsets included) and launches nothing."""
    for index in range(count):
        config = sweep.draw_config(sweep.config_seed(11, index), limits)
        call = sweep.build_call(config, "cpu")
        omniattn.explain(call.q, call.k, call.v, **call.arguments())
        if call.options.get("seqlens_k_per_row") is not None:
            lengths = call.options["seqlens_k_per_row"]
            assert lengths.dtype == torch.int32 and int(lengths.min()) >= 0
    again = sweep.build_call(config, "cpu")
    assert torch.equal(again.q, call.q) and torch.equal(again.dout, call.dout)


def _reference_as_kernel(corrupt):
    """An `attention` stand-in: the float32 reference, its results passed through `corrupt`
    (out, lse) -> (out, lse) inside the graph."""
    def attention(q, k, v, *, return_lse=False, deterministic=False, max_seqlen_q=None,
                  max_seqlen_k=None, **options):
        out, lse = corrupt(*attention_reference(q, k, v, return_lse=True, **options))
        return (out, lse) if return_lse else out
    return attention


def _find_config(predicate, limits=TINY):
    """The first drawn config of sweep seed 0 (within `limits`) for which predicate holds."""
    for index in range(1000):
        config = sweep.draw_config(sweep.config_seed(0, index), limits)
        if predicate(config):
            return config
    raise AssertionError("no such config drawn")


def test_check_quantity_flags_wrong_values():
    generator = torch.Generator().manual_seed(0)
    reference = torch.randn(4, 32, 8, dtype=torch.float64, generator=generator)
    plain = reference + 1e-3 * torch.randn(reference.shape, dtype=torch.float64,
                                           generator=generator)
    assert sweep.check_quantity("out", reference.half(), reference, plain).passed
    wrong = reference.clone()
    wrong[1, 2, 3] += 0.05
    check = sweep.check_quantity("out", wrong, reference, plain)
    assert not check.passed and check.error == pytest.approx(0.05, rel=1e-6)
    nan = reference.clone()
    nan[0, 0, 0] = float("nan")
    assert "NaN" in sweep.check_quantity("out", nan, reference, plain).reason
    # a NaN of the plain baseline does not widen the bound
    plain_nan = plain.clone()
    plain_nan[0, 0, 0] = float("nan")
    assert not sweep.check_quantity("out", wrong, reference, plain_nan).passed
    assert not sweep.check_quantity("out", reference[:2], reference, plain).passed
    # an all-zero reference leaves only the absolute floor
    zeros = torch.zeros(8, dtype=torch.float64)
    assert not sweep.check_quantity("dbias", zeros + 2 * sweep.ABSOLUTE_FLOOR, zeros, zeros).passed
    lse = torch.tensor([1.0, float("-inf")])
    assert sweep.check_quantity("lse", lse, lse.double(), lse).passed
    assert not sweep.check_quantity("lse", torch.tensor([1.0, 0.0]), lse.double(), lse).passed


def test_run_config_passes_the_reference_itself(monkeypatch):
    monkeypatch.setattr(omniattn, "attention", _reference_as_kernel(lambda out, lse: (out, lse)))
    config = _find_config(lambda c: c.backward and c.return_lse and c.bias is not None
                          and c.bias.requires_grad)
    result = sweep.run_config(config, "cpu")
    assert result.passed, sweep.detail(result)
    assert {c.name for c in result.checks} >= {"out", "lse", "dq", "dk", "dv", "dbias"}


@pytest.mark.parametrize("quantity", ["out", "lse", "dk", "dbias"])
def test_run_config_flags_a_wrong_result(monkeypatch, quantity):
    """A perturbed output, lse or gradient (through a wrong backward) fails its quantity."""
    class ScaleGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad * 1.05

    def corrupt(out, lse):
        if quantity == "out":
            return out + 0.02 * out.detach().abs().max(), lse
        if quantity == "lse":
            return out, lse + 0.05
        return out, lse

    attention = _reference_as_kernel(corrupt)

    def wrong_backward(q, k, v, attn_bias=None, **kwargs):
        if quantity == "dk":
            k = ScaleGradient.apply(k)
        if quantity == "dbias" and attn_bias is not None:
            attn_bias = ScaleGradient.apply(attn_bias)
        return attention(q, k, v, attn_bias=attn_bias, **kwargs)

    monkeypatch.setattr(omniattn, "attention", wrong_backward)
    config = _find_config(lambda c: c.backward and c.return_lse and c.bias is not None
                          and c.bias.requires_grad and c.bias.shape[-1] > 1
                          and c.seqlen_k > 1)
    result = sweep.run_config(config, "cpu")
    failed = [c.name for c in result.checks if not c.passed]
    assert quantity in failed, sweep.detail(result)


def test_rows_that_see_no_key_must_be_exactly_zero(monkeypatch):
    """1e-9 in the output of a row that sees no key passes the error bound, not the rule."""
    def corrupt(out, lse):
        empty = torch.isneginf(lse).transpose(1, 2)[..., None]
        return torch.where(empty, out + 1e-9, out), lse

    monkeypatch.setattr(omniattn, "attention", _reference_as_kernel(corrupt))
    config = _find_config(lambda c: c.causal and not c.varlen and c.seqlen_q > c.seqlen_k + 1
                          and c.window is None)
    result = sweep.run_config(config, "cpu")
    failed = {c.name: c for c in result.checks if not c.passed}
    assert set(failed) == {"out" + sweep.EMPTY_ROWS}, sweep.detail(result)


def test_a_raising_call_fails_its_config(monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("no")

    monkeypatch.setattr(omniattn, "attention", broken)
    result = sweep.run_config(sweep.draw_config(1, TINY), "cpu")
    assert not result.passed and "raised ValueError" in result.failures()


@pytest.mark.interpreter
@pytest.mark.skipif(GPU, reason="the tiny interpreter draws")
def test_cli_sweep_end_to_end(monkeypatch, capsys):
    """`check --sweep 2 --seed 0` on the interpreter kernels passes and reports; a failing
    config prints the command that re-runs it alone, and that command runs the same config."""
    monkeypatch.setattr(sweep.configs, "INTERPRETER_LIMITS", TINY)  # where limits_for reads it
    assert cli.main(["check", "--sweep", "2", "--seed", "0"]) == 0
    printed = capsys.readouterr().out
    assert "total: 2 configs, 2 passed, 0 failed" in printed
    assert "family" in printed

    seeds = [sweep.config_seed(0, i) for i in range(2)]
    monkeypatch.setattr(omniattn, "attention", _reference_as_kernel(
        lambda out, lse: (out + 1e-2, lse)))
    assert cli.main(["check", "--sweep", "2", "--seed", "0"]) == 1
    printed = capsys.readouterr().out
    assert "2 failed" in printed
    for seed in seeds:
        assert f"omniattn check --config {seed}  # out: error" in printed
    assert cli.main(["check", "--config", str(seeds[1])]) == 1
    detail = capsys.readouterr().out
    assert f"config {seeds[1]}: {sweep.draw_config(seeds[1], TINY).describe()}" in detail


def test_cli_rejects_a_seed_without_a_sweep(capsys):
    assert cli.main(["check", "--seed", "3"]) == 2
    assert cli.main(["check", "--sweep", "2", "--config", "5"]) == 2
    with pytest.raises(SystemExit):
        cli.main(["check", "--sweep", "0"])


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
def test_gpu_sweep():
    """20 configs on the GPU kernels, in 4 worker processes."""
    results = sweep.sweep(20, 0, torch.device("cuda"), jobs=4, progress=False)
    assert len(results) == 20
    failed = [r for r in results if not r.passed]
    assert not failed, sweep.report(results, 20)
