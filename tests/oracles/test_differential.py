"""Random programs against the same programs without remat (tests/support/differential.py).

REMAT_DIFFERENTIAL_PROGRAMS sets how many programs run (seeds from REMAT_DIFFERENTIAL_START on,
0 by default, so that a long survey can run in parts), in test
cases of BATCH programs, spread over REMAT_DIFFERENTIAL_WORKERS worker processes (default:
one per usable CPU), which check every graph as conftest does for a test (and, outside
pytest, skip the structured-trace logging it turns on in torch). Each failing program is
saved as a standalone repro file in REMAT_REPRO_DIR
(default: differential_repros/ under pytest's base temporary directory);
`python tests/support/differential.py --shrink SEED` turns off the constructs it fails without.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch

import differential
from conftest import check_every_graph

pytestmark = [
    pytest.mark.differential,
    pytest.mark.filterwarnings("ignore::remat.RematPolicyWarning"),  # name policies may name values a program lacks
]

BASE_SEED = int(os.environ.get("REMAT_DIFFERENTIAL_START", "0"))
PROGRAMS = int(os.environ.get("REMAT_DIFFERENTIAL_PROGRAMS", "3000"))
BATCH = 100
STARTS = range(BASE_SEED, BASE_SEED + PROGRAMS, BATCH)
WORKERS = max(1, int(os.environ.get("REMAT_DIFFERENTIAL_WORKERS", len(os.sched_getaffinity(0)))))

Runner = Callable[[Iterable[int]], list[differential.Result]]


def _start_worker() -> None:
    torch.set_num_threads(1)  # the programs' tensors are tiny; threads would only contend
    check_every_graph(setattr)


@pytest.fixture(scope="module")
def run_seeds() -> Iterator[Runner]:
    """Runs seeds in worker processes, spawned: a fresh torch in each."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(WORKERS, mp_context=context, initializer=_start_worker) as pool:
        yield lambda seeds: list(pool.map(differential.run_seed, seeds, chunksize=5))


@pytest.fixture(scope="session")
def repro_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    configured = os.environ.get("REMAT_REPRO_DIR")
    return Path(configured) if configured else tmp_path_factory.getbasetemp() / "differential_repros"


@pytest.mark.parametrize("start", STARTS, ids=lambda s: f"seeds{s}-{min(s + BATCH, BASE_SEED + PROGRAMS) - 1}")
def test_random_programs_match_no_remat(
    start: int, run_seeds: Runner, repro_dir: Path, request: pytest.FixtureRequest
) -> None:
    results = run_seeds(range(start, min(start + BATCH, BASE_SEED + PROGRAMS)))
    request.node.user_properties.append(("differential", [r.outcome for r in results]))
    failures = [r for r in results if r.outcome not in differential.harness.ACCEPTABLE]
    if failures:
        for r in failures:
            differential.save_repro(differential.generate(r.seed), repro_dir)
        header = (
            f"{len(failures)} of {len(results)} programs differ from the same program without remat; repro files "
            f"{differential.REPRO_NAME.format(seed='SEED')} in {repro_dir}; "
            "`python tests/support/differential.py --shrink SEED` turns off the constructs a failure does not need:"
        )
        pytest.fail("\n".join([header, *_by_kind(failures)]), pytrace=False)


def _by_kind(failures: list[differential.Result]) -> list[str]:
    """Three lines per kind of failure: its seeds, the constructs of those programs, and
    the first one's program and first difference."""
    kinds: dict[str, list[differential.Result]] = {}
    for r in failures:
        kinds.setdefault(differential.failure_kind(r.detail), []).append(r)
    lines = []
    for kind, members in sorted(kinds.items(), key=lambda kv: -len(kv[1])):
        counts = Counter(c for r in members for c in r.constructs).most_common()
        first = members[0]
        constructs = ", ".join(sorted(first.constructs)) + (" (random draws)" if first.random else "")
        lines += [
            f"  {kind} ({len(members)}): seeds {' '.join(str(r.seed) for r in members)}",
            f"    constructs in these programs: {', '.join(f'{c} {n}' for c, n in counts)}",
            f"    e.g. seed {first.seed} [{constructs}] {'+'.join(first.transforms)}, policy {first.policy}, "
            f"{first.precision}: "
            + first.detail[:240],
        ]
    return lines
