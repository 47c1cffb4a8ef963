"""The scaling planner: ``cost`` is the alpha-beta cost model of data-parallel steps and their
memory per ``zero_stage``; ``measure`` calibrates it on the machine at hand and runs
``jaxdist plan``. The cost model's names are re-exported here (``jaxdist.plan.predict``, ...).
"""

from jaxdist.plan.cost import ALGORITHMS as ALGORITHMS
from jaxdist.plan.cost import GB as GB
from jaxdist.plan.cost import LINKS as LINKS
from jaxdist.plan.cost import OPTIMIZER_SLOTS as OPTIMIZER_SLOTS
from jaxdist.plan.cost import PRECISIONS as PRECISIONS
from jaxdist.plan.cost import Link as Link
from jaxdist.plan.cost import Prediction as Prediction
from jaxdist.plan.cost import Recommendation as Recommendation
from jaxdist.plan.cost import StageMemory as StageMemory
from jaxdist.plan.cost import allreduce_time as allreduce_time
from jaxdist.plan.cost import predict as predict
from jaxdist.plan.cost import recommend as recommend
from jaxdist.plan.cost import recommend_stage as recommend_stage
from jaxdist.plan.cost import stage_memory as stage_memory

__all__ = ["ALGORITHMS", "GB", "LINKS", "Link", "OPTIMIZER_SLOTS", "PRECISIONS", "Prediction",
           "Recommendation", "StageMemory", "allreduce_time", "predict", "recommend",
           "recommend_stage", "stage_memory"]
