"""docs/families.md's placement table (what each placement holds per rank, N = 8) is the
planner's: ``python -m benchmarks.bench_plan --families-md`` writes it. Its rows (every
published pipeline's components, by class) are checked here; its numbers take the planner
about 30 s of meta-device forwards, too long for this tier:
``python -m benchmarks.bench_plan --families-md --check`` compares them all."""

from __future__ import annotations

import pytest

from benchmarks.bench_plan import FAMILIES_MD, TABLE_BEGIN, TABLE_END, documented_table, with_table

pytestmark = pytest.mark.unit


def test_the_documented_table_has_a_row_per_published_pipeline_and_component():
    from diffusers_zero3.placement.known_pipelines import KNOWN_PIPELINES
    from diffusers_zero3.placement.plan import pipeline_components

    expected = [
        (known["title"], name, comp.class_name)
        for key, known in KNOWN_PIPELINES.items()
        for name, comp in pipeline_components(key)[1].items()
    ]
    rows = [line.split(" | ") for line in documented_table(FAMILIES_MD.read_text()).splitlines()[2:]]
    documented = [(row[0].removeprefix("| "), row[1], row[2]) for row in rows]
    assert documented == expected, (
        "docs/families.md's placement table is stale: run `python -m benchmarks.bench_plan --families-md`"
    )


def test_the_rewrite_replaces_only_the_marked_block():
    text = f"# title\nbefore\n{TABLE_BEGIN}\n| old |\n|---|\n{TABLE_END}\nafter\n"
    new = with_table(text, "| new |\n|---|")
    assert new == f"# title\nbefore\n{TABLE_BEGIN}\n| new |\n|---|\n{TABLE_END}\nafter\n"
    assert documented_table(new) == "| new |\n|---|"
    with pytest.raises(ValueError, match="placement table"):
        documented_table("# no markers\n")
