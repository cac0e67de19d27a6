"""draftlab.plan.planning: store bytes, packed steps from the trainer's own sampler, wall-clock per GPU
count, warnings, and the Kimi-K2.5 reference scenario pinned."""

from __future__ import annotations

import dataclasses

import pytest

from draftlab.plan import planning as pl
from draftlab.plan import steps as plan_steps

KIMI = dict(num_samples=37_312, num_tokens=87_800_000, hidden_size=7168, dtype="bfloat16", train_ratio=0.95,
            total_seq_len=4096, epochs=5, world_size=4, seed=0, lr_scaling="none", lr_base_gpus=1,
            num_workers=12, prefetch_factor=4)
REF_STEPS_PER_S = 1.4  # the reference run's measured rate, one sample per rank-step
REF_TOKENS_PER_RANK_STEP = 87_800_000 / 37_312  # ≈ 2,353: its mean sample length


@pytest.fixture(scope="module")
def kimi_plan():
    ref = pl.reference_run_hours(train_samples=35_446, epochs=5, steps_per_s=REF_STEPS_PER_S, world_size=4,
                                 tokens_per_rank_step=REF_TOKENS_PER_RANK_STEP)
    plan = pl.make_plan(pl.Scenario(**KIMI), gpu_counts=(4,),
                        stated=pl.Throughput(4, ref.tokens_per_s),
                        shm_bytes=pl.CONTAINER_DEFAULT_SHM_BYTES, disk_free=2 * 2**40,
                        observed_steps_per_epoch=35_446)
    return plan, ref


def test_kimi_k2_5_reference_scenario(kimi_plan):
    plan, ref = kimi_plan
    s = plan.scenario
    # the store: 57,352 B per token (4 × 7168 × 2 + an int64 id) + one header per file
    assert plan.store_bytes == pytest.approx(5.03e12, rel=3e-3)
    assert plan.store_bytes / 2**40 == pytest.approx(4.58, abs=0.01)  # the reference run's "4.6 TB"
    assert (s.train_samples, s.num_samples - s.train_samples) == (35_446, 1_866)

    # steps from speculators' packing sampler, over a stated range of length distributions
    st = plan.steps
    lo, hi = st.bounds_per_epoch
    assert (lo, hi) == (5_091, 8_861)  # ceil(83.4 M / (4 × 4096)) .. floor(35,446 / 4): any packing
    assert lo < st.steps_per_epoch[0] < st.steps_per_epoch[1] < hi
    assert st.steps_per_epoch == (pytest.approx(5_804, rel=0.01), pytest.approx(6_447, rel=0.01))
    assert st.total_steps == (5 * st.steps_per_epoch[0], 5 * st.steps_per_epoch[1])
    assert "lognormal" in st.basis and "2,353" in st.basis and not st.exact
    assert st.total_steps[1] < 177_230 / 5  # a fifth of the reference run's per-rank "batches"

    # wall-clock: 5 sharded epochs at the reference throughput ≈ 8.8 h, a quarter of its 35 h
    assert ref.tokens_per_s == pytest.approx(13_200, rel=0.005)
    (row,) = plan.rows
    assert row.gpus == 4 and row.throughput_source == "stated tokens/s at 4 GPU(s)"
    assert row.wall_clock_s / 3600 == pytest.approx(8.8, abs=0.05)
    assert row.gpu_hours == pytest.approx(4 * 8.8, abs=0.2)
    assert ref.unsharded_steps == 177_230
    assert ref.unsharded_hours == pytest.approx(35.2, abs=0.05)
    assert ref.sharded_hours == pytest.approx(row.wall_clock_s / 3600, rel=1e-3)
    assert ref.waste_factor == pytest.approx(4.0)

    # warnings: ranks repeating data, lr not scaled, 2 TiB disk, docker's 64 MB /dev/shm
    codes = {w.code for w in plan.warnings}
    assert codes == {"not-sharded", "lr-not-scaled", "disk-too-small", "shm-too-small"}
    shm = next(w for w in plan.warnings if w.code == "shm-too-small")
    assert "12 workers × prefetch 4" in shm.message
    # at speculators' default 8,192-token rows: ~470 MB per batch, ~22.5 GB in flight per rank
    assert pl.batch_bytes(8192, 7168, "bfloat16") == pytest.approx(470e6, rel=0.002)
    assert pl.loader_inflight_bytes(8192, 7168, "bfloat16", 12, 4) == pytest.approx(22.5e9, rel=0.005)
    assert pl.loader_inflight_bytes(8192, 7168, "bfloat16", 12, 4) > 300 * pl.CONTAINER_DEFAULT_SHM_BYTES


def test_a_sound_plan_has_no_warnings(kimi_plan):
    plan, _ = kimi_plan
    fixed = dataclasses.replace(plan, scenario=dataclasses.replace(plan.scenario, lr_scaling="sqrt", num_workers=0),
                                loader_inflight_bytes=0, disk_free_bytes=8 * 2**40, shm_free_bytes=16 * 2**30)
    assert pl.check_plan(fixed, observed_steps_per_epoch=plan.steps.steps_per_epoch[1]) == []
    assert [w.code for w in pl.check_plan(fixed, sharded=False)] == ["not-sharded"]


def test_nearest_point_and_stated_throughput():
    from draftlab.plan import costmodel as cm

    four = cm.stated_point(4, 13_200.0, tokens_per_step=2_640.0)
    one = cm.Point(1, 30.0, 0.5, 4.0, 3_000.0, 20, 2, 44.0, source="mlflow run abc")
    assert four.step_s == pytest.approx(0.2) and four.fixed_s == 0
    assert cm.nearest({4: four, 1: one}, 4) == (four, "stated tokens/s at 4 GPU(s)")
    p8, how8 = cm.nearest({4: four, 1: one}, 8)
    assert p8 is four and "s/step held" in how8
    assert cm.nearest({4: four, 1: one}, 2)[0] is four  # equidistant in log2: the larger count wins
    assert cm.nearest({}, 4) is None
    assert pl.tokens_per_s_from_steps(1.4, 4, 2_353) == pytest.approx(13_176.8)


def test_store_bytes_is_payload_plus_headers():
    assert pl.store_bytes(10, 2, 64, "bfloat16") == 10 * (4 * 64 * 2 + 8) + 2 * pl.SAFETENSORS_HEADER_BYTES
    assert pl.store_bytes(10, 2, 64, "float32") > pl.store_bytes(10, 2, 64, "bfloat16")


def test_header_constant_matches_a_real_file():
    import torch
    from safetensors.torch import save

    blob = save({"hidden_states": torch.zeros(3000, 4, 16, dtype=torch.bfloat16),
                 "token_ids": torch.zeros(3000, dtype=torch.long)})
    # the JSON header grows with the digits of shapes and offsets: 168 B at Kimi sizes (1e8-byte files)
    assert 0 <= pl.store_bytes(3000, 1, 16, "bfloat16") - len(blob) <= 16


def test_synthesised_lengths_keep_the_stated_counts():
    for sigma in plan_steps.LENGTH_SIGMAS:
        x = plan_steps.synthesise_lengths(1000, 1_500_000, sigma=sigma, max_len=4096, seed=3)
        assert len(x) == 1000 and int(x.sum()) == 1_500_000 and x.min() >= 1 and x.max() <= 4096
    with pytest.raises(ValueError):
        plan_steps.synthesise_lengths(10, 10 * 4097, sigma=0.5, max_len=4096)


def test_rank0_step_count_is_the_accounting_count():
    """The counts shortcut (rank 0, standalone sampler file) agrees with draftlab.plan.accounting,
    which builds every rank's sampler through the speculators package."""
    import numpy as np

    from draftlab.plan import accounting as acc

    lengths = [int(x) for x in np.random.default_rng(1).integers(20, 700, 300)]
    from draftlab import pinned

    standalone = pinned._standalone("train.distributed_batch_sampler").MultipackDistributedBatchSamplerV2
    for w in (1, 2, 4):
        a = acc.plan_epochs(lengths, total_seq_len=1024, world_size=w, epochs=2, seed=5)
        for e in a.epochs:
            assert plan_steps.epoch_steps(lengths, total_seq_len=1024, world_size=w, seed=5, epoch=e.epoch) == e.steps
            s = standalone(batch_max_length=1024, lengths=lengths, num_replicas=w, rank=w - 1, seed=5)
            s.set_epoch(e.epoch)
            assert len(s) == e.steps
        exact = plan_steps.plan_from_lengths(lengths, total_seq_len=1024, world_size=w, epochs=2, seed=5)
        assert exact.exact and exact.total_steps[0] == a.total_steps


def test_plan_from_dataset_lengths_is_exact_and_warns_on_truncation():
    lengths = [100] * 50 + [1500] * 10  # 60 rows, train split 54: 4 of its rows are longer than 1024
    s = pl.Scenario(num_samples=60, num_tokens=sum(lengths), hidden_size=64, train_ratio=0.9, total_seq_len=1024,
                    epochs=2, world_size=2, lr_scaling="linear", num_workers=2, prefetch_factor=2)
    from draftlab.plan.costmodel import Point

    cal = Point(1, fixed_s=30.0, step_s=0.5, epoch_s=4.0, tokens_per_s=1000.0, steps=21, epochs=2, wall_s=44.5,
                source="calibration trial 0", measured_at=1_000.0)
    plan = pl.make_plan(s, lengths=lengths, gpu_counts=(1, 2), points={1: cal}, now=1_000.0 + 7200)
    assert plan.steps.exact and plan.steps.truncated_samples == 4  # the last 6 rows are validation
    assert plan.steps.trained_tokens_per_epoch == 50 * 100 + 4 * 1024
    assert plan.store_bytes == pl.store_bytes(sum(lengths), 60, 64)
    assert [w.code for w in plan.warnings] == ["samples-truncated"]
    one, two = plan.rows
    assert one.throughput_source == "calibration trial 0 at 1 GPU(s); 2 h old"
    # start-up + steps × s/step + (epochs − 1) boundaries × s/epoch; at 2 GPUs s/step held
    assert one.wall_clock_s == pytest.approx(30 + one.total_steps[0] * 0.5 + 1 * 4.0)
    assert two.wall_clock_s == pytest.approx(30 + two.total_steps[0] * 0.5 + 1 * 4.0)
    assert "s/step held" in two.throughput_source and two.total_steps[0] < one.total_steps[0]
    assert plan.to_json()["train_samples"] == 54


def test_batch_bytes_matches_speculators_collate():
    """What one packed row of speculators' CollateFn holds, tensor by tensor."""
    import torch
    from speculators.train.data import CollateFn

    h, total = 16, 64

    def sample(n):
        return {"hidden_states": torch.zeros(n, 3 * h, dtype=torch.bfloat16),
                "input_ids": torch.zeros(n, dtype=torch.long),
                "verifier_last_hidden_states": torch.zeros(n, h, dtype=torch.bfloat16),
                "loss_mask": torch.ones(n, dtype=torch.long), "lengths": torch.tensor([n]),
                "position_ids": torch.arange(n)}

    batch = CollateFn(total, h)([sample(20), sample(30)])
    held = sum(v.numel() * v.element_size() for v in batch.values() if isinstance(v, torch.Tensor))
    assert held == pl.batch_bytes(total, h, "bfloat16")


def test_plan_json_is_serialisable(kimi_plan):
    import json

    out = json.loads(json.dumps(kimi_plan[0].to_json()))
    assert out["steps"]["bounds_per_epoch"] == [5_091, 8_861] and out["rows"][0]["throughput_source"].startswith("stated")
    assert {w["code"] for w in out["warnings"]} >= {"shm-too-small", "lr-not-scaled"}


def test_plan_table_renders(kimi_plan):
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(pl.plan_table(kimi_plan[0]))
    text = console.export_text()
    assert "4.58 TiB" in text and "8.8 h" in text and "shm-too-small" in text


REF_EXTRACTION_TOKENS_PER_S = 87_800_000 / (9.4 * 3600)  # the reference run: 87.8 M tokens extracted in 9.4 h


def test_the_plan_prices_online_training_against_the_reference_store():
    """The reference scenario (4.6 TiB, 9.4 h of extraction, 5 epochs at 13.2 k tokens/s on 4 GPUs):
    offline costs the store and one extraction; online no disk, but the target's forward every
    epoch: five extractions' worth, so offline is cheaper; at one epoch online is cheaper only when
    loader workers hide the forward."""
    from draftlab.plan import modes

    ref = pl.reference_run_hours(train_samples=35_446, epochs=5, steps_per_s=REF_STEPS_PER_S, world_size=4,
                                 tokens_per_rank_step=REF_TOKENS_PER_RANK_STEP)
    plan = pl.make_plan(pl.Scenario(**KIMI), gpu_counts=(4,), stated=pl.Throughput(4, ref.tokens_per_s),
                        extract_tokens_per_s=pl.Throughput(1, REF_EXTRACTION_TOKENS_PER_S, "stated"))
    c = plan.modes
    assert c.offline.disk_bytes == plan.store_bytes and c.offline.disk_bytes / 2**40 == pytest.approx(4.58, abs=0.01)
    assert c.online.disk_bytes == 0
    assert c.offline.forward_hours == pytest.approx(9.4, abs=0.01)
    assert c.online.forward_hours == pytest.approx(5 * 9.4, abs=0.05)
    train_h = plan.rows[0].wall_clock_s / 3600
    assert c.offline.train_hours == c.online.train_hours == pytest.approx(train_h)
    assert c.offline.total_hours == pytest.approx(9.4 + train_h, abs=0.01)
    assert c.online.total_hours == pytest.approx(47 + train_h, abs=0.05)
    assert c.online.overlapped_hours == pytest.approx(47, abs=0.05)
    # a step's real tokens through the target: ~14.4 k tokens per 4-rank step at ~2.6 k tokens/s
    per_step_tokens = plan.steps.trained_tokens_per_epoch / (plan.steps.central_total_steps / 5)
    assert c.forward_s_per_step == pytest.approx(per_step_tokens / REF_EXTRACTION_TOKENS_PER_S, rel=0.01)
    assert c.cheaper_wall_clock == "offline"
    assert c.verdict.startswith("offline costs less wall-clock") and "4.58 TiB" in c.verdict
    assert "offline" in str(modes.modes_table(c).title) and "online" in pl.plan_table(plan).renderables[-1]

    one = pl.make_plan(pl.Scenario(**{**KIMI, "epochs": 1}), gpu_counts=(4,), stated=pl.Throughput(4, ref.tokens_per_s),
                       extract_tokens_per_s=pl.Throughput(1, REF_EXTRACTION_TOKENS_PER_S, "stated"))
    assert one.modes.cheaper_wall_clock == "online with workers"
    assert one.modes.online.overlapped_hours == pytest.approx(9.4, abs=0.05)
    assert one.modes.online.overlapped_hours < one.modes.offline.total_hours <= one.modes.online.total_hours


def test_without_a_forward_throughput_the_plan_says_what_to_give():
    plan = pl.make_plan(pl.Scenario(**KIMI), gpu_counts=(4,), stated=pl.Throughput(4, 13_200))
    assert plan.modes.cheaper_wall_clock is None and plan.modes.online.disk_bytes == 0
    assert "--extract-tokens-per-s" in plan.modes.verdict and "saves the 4.58 TiB store" in plan.modes.verdict
    assert plan.to_json()["modes"]["online"]["disk_bytes"] == 0
