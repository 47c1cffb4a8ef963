"""The input path: ``strategy.distribute`` (each process's share of a global batch, padded and
masked, placed on the devices), per-process pipelines and input contexts, and the built-in
datasets (``jaxdist.datasets``).
"""

from jaxdist.input.context import DatasetFromFunction as DatasetFromFunction
from jaxdist.input.context import InputContext as InputContext
from jaxdist.input.dataset import Batch as Batch
from jaxdist.input.dataset import DistributedDataset as DistributedDataset
from jaxdist.input.dataset import DistributedIterator as DistributedIterator
from jaxdist.input.dataset import check_batch_leaves as check_batch_leaves
from jaxdist.input.local import AutoShardPolicy as AutoShardPolicy
from jaxdist.input.local import FileSource as FileSource
from jaxdist.input.local import InputSyncTimeoutError as InputSyncTimeoutError
from jaxdist.input.local import ShardableSource as ShardableSource

__all__ = ["AutoShardPolicy", "Batch", "DatasetFromFunction", "DistributedDataset",
           "DistributedIterator", "FileSource", "InputContext", "InputSyncTimeoutError",
           "ShardableSource", "check_batch_leaves"]
