"""The result types of the benchmarks (``skippy-wire bench``): timed rows and goal ratios.
Every benchmark module yields these; ``skippy_wire.tools.bench`` prints them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable, Iterable, Union


@dataclass
class Row:
    """One timed operation: ``seconds`` per call on ``nbytes`` of f32 activation."""

    op: str
    size: str
    impl: str
    seconds: float
    nbytes: int

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9


@dataclass
class Ratio:
    """A goal: ``ratio`` (higher is better) must reach ``target``."""

    goal: str
    ratio: float
    target: float
    detail: str = ""

    @property
    def met(self) -> bool:
        return self.ratio >= self.target


Producer = Callable[[argparse.Namespace], Iterable[Union[Row, Ratio]]]
