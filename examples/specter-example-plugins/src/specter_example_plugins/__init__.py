"""Example third-party Specter plugins, one of each kind a package can add.

- ``example-fifo`` (cache policy): evicts the expert that entered the cache first.
- ``example-counting`` (link): a synchronous copy that counts what it moves.
- ``example-previous`` (predictor): predicts that the target needs the experts its previous
  token used.
- ``example-greedy-k`` (governor): drafts one more token after a round that kept every draft,
  one fewer after a round that kept less than a threshold.
- ``example-warm`` (engine): ``ondemand`` with its expert cache filled before the first prompt
  (``specter_example_plugins.warm_engine``, imported only when the engine is built).

``specter_example_plugins.hooks`` registers them (the ``specter`` entry point of this package).
"""

from specter_example_plugins.counting_link import CountingLink
from specter_example_plugins.fifo import FifoPolicy
from specter_example_plugins.greedy_k import GreedyKGovernor
from specter_example_plugins.previous import PreviousTokenPredictor

__all__ = ["CountingLink", "FifoPolicy", "GreedyKGovernor", "PreviousTokenPredictor"]
