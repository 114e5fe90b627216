"""Training-loop API: eager-SGD, RNA, backup workers, OD-SGD and top-k SGD.

Each optimiser owns a flat parameter bucket and offers ``await opt.step(grads) -> StepInfo``
and ``await opt.finish()`` (collective, after the last step). See ``docs/training.md``.
"""

from .backup import BackupSGD
from .bucket import ParamBucket
from .eager import EagerSGD
from .info import StepInfo
from .odsgd import ODSGD
from .rna import RNA
from .topk_sgd import TopKSGD
from .updaters import DCASGD, SGD, make_updater

__all__ = ["DCASGD", "ODSGD", "RNA", "SGD", "BackupSGD", "EagerSGD", "ParamBucket", "StepInfo",
           "TopKSGD", "make_updater"]
