"""The published pipelines the planner carries, for ``python -m diffusers_zero3.placement.plan`` where
there is no hub: each family's ``published()`` configs, by hub id.

Each entry gives the pipeline class (``model_index.json``'s ``_class_name``), a title, a note
and, per component folder, the library, the class and the config keys that set parameter
shapes. A plan builds these on the meta device, so the parameter counts are exact.
"""

from __future__ import annotations

from ..families import ALL_FAMILIES

KNOWN_PIPELINES: dict[str, dict] = {
    published.hub_id: {
        "title": published.title,
        "_class_name": published.pipeline_class,
        "components": published.components,
        "note": published.note,
        "family": family.name,
    }
    for family in ALL_FAMILIES
    for published in family.published()
}
