"""Recipes: the schema of every key (``recipe``, over the machinery of ``schema``), expert budgets
(``budget``), YAML and override loading (``loading``), prompt files (``files``).

Nothing here runs a model; ``load_recipe`` returns a validated, frozen ``Recipe`` or raises a
``RecipeError`` whose message is one line naming the key.
"""

from specter.config.budget import ExpertBudget
from specter.config.loading import describe, load_recipe, recipe_keys
from specter.config.recipe import Recipe

__all__ = ["ExpertBudget", "Recipe", "describe", "load_recipe", "recipe_keys"]
