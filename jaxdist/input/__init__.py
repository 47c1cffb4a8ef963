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
from jaxdist.input.protocols import EpochIterator as EpochIterator
from jaxdist.input.protocols import EpochSource as EpochSource
from jaxdist.input.protocols import GroupedEpochSource as GroupedEpochSource

__all__ = ["AutoShardPolicy", "Batch", "DatasetFromFunction", "DistributedDataset",
           "DistributedIterator", "EpochIterator", "EpochSource", "FileSource", "GroupedEpochSource",
           "InputContext", "InputSyncTimeoutError", "ShardableSource", "check_batch_leaves"]
