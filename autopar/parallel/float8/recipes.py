"""torchao's float8 training recipes, by name, and the one place torchao is imported.

torchao is an optional dependency (pinned in requirements-test.txt): ``ap.Float8`` and the
torchao-converted models need it, nothing else does. Its absence is a PlanError that says how
to install it.

A recipe is torchao's ``Float8LinearConfig.from_recipe_name(name)``: six casts (the input, the
weight and the output gradient, each for the gemm it feeds) with their granularity
(tensorwise: one scale per tensor; axiswise: one per row or column) and dtype (e4m3, e5m2).

Example:
    >>> config("rowwise").cast_config_input.scaling_granularity.value
    'axiswise'
    >>> recipe_of(config("tensorwise"))
    'tensorwise'
"""

from __future__ import annotations

from autopar.errors import PlanError

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
TORCHAO_PIN = "torchao==0.18.0"


def torchao_float8():
    """The ``torchao.float8`` module, or a PlanError saying how to install it."""
    try:
        import torchao.float8 as float8  # optional dependency: imported only when float8 is asked for
    except ImportError as e:
        raise PlanError(
            f"ap.Float8 needs torchao ({e}); install the version autopar is tested with: "
            f"pip install {TORCHAO_PIN}  (or drop float8= from ap.plan)."
        ) from e
    return float8


def config(recipe: str):
    """torchao's Float8LinearConfig for ``recipe`` (one of RECIPES)."""
    if recipe not in RECIPES:
        raise PlanError(f"ap.Float8(recipe={recipe!r}): the recipes are {', '.join(RECIPES)} (torchao's names).")
    return torchao_float8().Float8LinearConfig.from_recipe_name(recipe)


def recipe_of(cfg) -> str:
    """The recipe name of a torchao Float8LinearConfig (a converted model's), or a PlanError: autopar
    runs torchao's named recipes, whose every cast it knows how to scale across ranks (the config's
    ``enable_fsdp_float8_all_gather`` is ap.Float8's ``fp8_all_gather``, not part of the recipe)."""
    plain = cfg.__class__(**{**cfg.__dict__, "enable_fsdp_float8_all_gather": False})
    for name in RECIPES:
        if plain == config(name):
            return name
    raise PlanError(
        f"a torchao Float8Linear with a config that is none of torchao's recipes ({cfg}); autopar runs "
        f"{', '.join(RECIPES)}: convert with Float8LinearConfig.from_recipe_name(name)."
    )
