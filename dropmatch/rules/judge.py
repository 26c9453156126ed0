"""An AutoJudge-style trained judge (Garipov et al., 2025) as an acceptance criterion.

The judge is a fitted scaler + logistic regression on two target last hidden states (2d features):
the one that scores the position and the one after consuming the draft token. Mining and training
live in :mod:`dropmatch.judge_mining`; this module only loads a judge and applies it. Accept a draft
token that exact match rejects when the judge's probability of "important" is below a threshold.
Threshold 0 is exact match.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError
from .base import PositionTest, VerifyInput


class Judge:
    """A fitted scaler + logistic regression on target hidden states; ``p_important(h)``."""

    def __init__(self, pipeline, info: dict):
        self.pipeline, self.info = pipeline, info

    def p_important(self, features: torch.Tensor | np.ndarray) -> np.ndarray:
        """Probability (n,) that each mismatch, with features (n, 2d) (see :func:`judge_features`), is important."""
        x = features.float().cpu().numpy() if torch.is_tensor(features) else np.asarray(features, dtype=np.float32)
        return self.pipeline.predict_proba(x)[:, 1]

    def save(self, path: str | Path) -> None:
        import joblib

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        joblib.dump({"pipeline": self.pipeline, "info": self.info}, path)

    @classmethod
    def load(cls, path: str | Path) -> Judge:
        import joblib

        if not Path(path).is_file():
            raise ConfigError(f"no judge file at {path}; train one with `python -m dropmatch judge train`")
        try:
            blob = joblib.load(path)
        except (ImportError, MemoryError):  # a judge file this environment cannot hold: not a format error
            raise
        except Exception as err:  # joblib/pickle raise many types for a file that is not theirs
            raise ConfigError(f"{path} is not a judge file ({type(err).__name__}: {err}); train one with "
                              "`python -m dropmatch judge train`") from None
        if not (isinstance(blob, dict) and {"pipeline", "info"} <= set(blob)):
            raise ConfigError(f"{path} is not a judge file (no pipeline and info); train one with "
                              "`python -m dropmatch judge train`")
        return cls(blob["pipeline"], blob["info"])


class JudgeCriterion:
    """Accept where the judge's P(important) < ``threshold`` (0: never, i.e. exact match)."""

    def __init__(self, judge: Judge, threshold: float):
        if not 0 <= threshold <= 1:
            raise ConfigError(f"judge threshold must be in [0, 1], got {threshold}")
        self.judge, self.threshold = judge, threshold
        self.name = f"judge-{threshold:g}"

    def prepare(self, inp: VerifyInput) -> PositionTest:
        cache: dict[int, float] = {}

        def test(j: int) -> bool:
            if j not in cache:
                features = inp.hidden[j : j + 2].reshape(1, -1)  # scoring state and state after draft token j
                cache[j] = float(self.judge.p_important(features)[0])
            return cache[j] < self.threshold

        return test
