"""Read a run's TensorBoard scalars: the scripts' only logging path, shared by the benchmarks."""

from pathlib import Path


def read_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """All scalars of a TensorBoard run folder: {tag: {step: value}}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
