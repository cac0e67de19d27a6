"""A real CPU training run whose data source is slowed flips the verdict to data-bound.

The slowdown is injected from outside draftlab: a `sitecustomize` on the ranks' PYTHONPATH wraps
speculators' hidden-state reader (`hs_connectors.FileTransfer.get_cached`) with a wait, as a slow
network filesystem would. The wait is 4x the typical time the rank spends between reads (its
compute), measured as it goes, so reading dominates every step on a fast host and on a loaded one
alike; the verdict's threshold is 15 %."""

import os

SLOW_READS = '''
import statistics
import time

import hs_connectors.transfer as t

_stock, _gaps, _end = t.FileTransfer.get_cached, [], [None]


def get_cached(self, file_idx):
    if _end[0] is not None and (gap := time.perf_counter() - _end[0]) > 1e-3:  # not the next sample of a batch
        _gaps[:] = (_gaps + [gap])[-5:]
    time.sleep(max(0.05, 4 * statistics.median(_gaps or [0.0])))
    try:
        return _stock(self, file_idx)
    finally:
        _end[0] = time.perf_counter()


t.FileTransfer.get_cached = get_cached
'''


def test_slow_data_source_is_called_data_bound(built, tmp_path, mlflow_store, monkeypatch):
    from draftlab.params import parse_params
    from draftlab.stages import train

    params, target_dir, data_dir, store_dir = built
    raw = params.model_dump()
    # 3 epochs (about 12 steps of the tiny default): the slowed reads, which wait 4x the compute once a
    # few gaps are known, outweigh step 0's one-off setup even when a loaded host stretches it (at 1
    # epoch, 4 steps, one run on a host at load 8+ was called compute-bound)
    raw["train"].update({"epochs": 3, "total_seq_len": 128, "draft_vocab_size": 64,
                         "num_workers": 0})  # reads in the rank, where the wait measures the compute
    p = parse_params(raw)

    def verdict(out):
        result = train.run(p, target_dir=target_dir, data_dir=data_dir, store_dir=store_dir, out_dir=out)
        return mlflow_store.get_run(result.run_id).data.tags["draftlab.bottleneck"]

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_READS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    slow = verdict(tmp_path / "slow")
    assert slow.startswith("data-bound"), slow
    evidence = (tmp_path / "slow" / "bottleneck.json").read_text()
    assert "data_wait" in evidence
