"""Metrics as ranks report them and as answers carry them: names, values (finite
numbers, or the strings of ddpq.wire's NaN codec), the points in and out, and the
conversions between a stored value and the wire."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import AfterValidator, BaseModel, Field, model_validator

from ddpq import rules
from ddpq.messages import INT32_MAX, INT64_MAX, Strict
from ddpq.wire import NonFinite, decode_number, encode_number
from service.schemas.common import MAX_NAME_CHARS

# One owner for the metric limits: ddpq.train checks them where report() is called.
MAX_METRIC_ITEMS = rules.MAX_METRIC_ITEMS
MAX_METRIC_NAMES = rules.MAX_METRIC_NAMES

Step = Annotated[int, Field(strict=True, ge=0, le=INT64_MAX)]
TotalSteps = Annotated[int, Field(strict=True, ge=1, le=INT64_MAX)]


def _printable_name(v: str) -> str:
    if not v.isprintable():
        raise ValueError("must be printable characters (no control or format characters)")
    return v


# Any printable unicode (a loss named "損失" round-trips), 1..200 characters.
MetricName = Annotated[
    str, Field(min_length=1, max_length=MAX_NAME_CHARS), AfterValidator(_printable_name)
]
# A metric value on input: a finite JSON number, or one of the three strings for the
# values JSON has no literal for (a diverged loss is information, so it is kept).
# Python's json module would also read bare NaN/Infinity tokens; they are refused so
# that one spelling exists. Answers carry non-finite values the same way, as strings,
# so every answer is valid JSON.
FiniteNumber = Annotated[float, Field(strict=True, allow_inf_nan=False)]
MetricValueIn = FiniteNumber | NonFinite
MetricValue = float | NonFinite


def metric_out(value: float | None) -> MetricValue:
    """A stored metric value as JSON can carry it (NULL is NaN, see MetricPoint)."""
    return "NaN" if value is None else encode_number(value)


def metric_in(value: float | str) -> float:
    return decode_number(value)


class LatestMetrics(BaseModel):
    """The job's newest step reported, its epoch, and each series' latest value (a
    series not reported at that step keeps the value it last had)."""

    step: int
    epoch: MetricValue | None
    values: dict[str, MetricValue | None]


class MetricItemIn(Strict):
    _strings_checked = True  # names: MetricName; values: numbers or NonFinite
    step: Step
    epoch: MetricValueIn | None = None
    # The job's, not a series: how many steps the run takes (the progress bar's end).
    # The job keeps the latest one sent. An older ddpq.train sends it among the
    # values instead; ingest.points_of takes it from there too.
    total_steps: TotalSteps | None = None
    values: dict[MetricName, MetricValueIn] = Field(default={}, max_length=MAX_METRIC_NAMES)

    @model_validator(mode="after")
    def _values_or_total(self) -> MetricItemIn:
        if not self.values and self.total_steps is None:
            raise ValueError("values: a point needs at least one metric (or a total_steps)")
        return self


class MetricsIn(Strict):
    _strings_checked = True
    items: list[MetricItemIn] = Field(default=[], max_length=MAX_METRIC_ITEMS)
    # Points the sender could not store (its buffer overflowed, or the API refused one
    # alone): added to the job's metrics_dropped, so a loss shows on the job.
    dropped: Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)] = 0

    @model_validator(mode="after")
    def _something(self) -> MetricsIn:
        if not self.items and not self.dropped:
            raise ValueError("items: send at least one point (or a dropped count)")
        return self


class MetricItemPublic(BaseModel):
    step: int
    epoch: MetricValue | None
    attempt: int
    time: datetime
    values: dict[str, MetricValue | None]


class SeriesCount(BaseModel):
    """How much of one series an answer holds, so a chart can say it shows fewer."""

    points: int = Field(
        description="the series' points the API holds from since_step on (after any "
        "downsampling in storage: the job's metrics_downsampled counts what that removed)"
    )
    shown: int = Field(description="of them, those in items")
    downsampled: bool = Field(description="max_points left some out (shown < points)")


class MetricsPublic(BaseModel):
    items: list[MetricItemPublic]
    # Added after items: an answer of an older API has none, so it defaults to empty.
    series: dict[str, SeriesCount] = Field(
        default={},
        description="each metric name in items: its points held and shown (GET "
        "/jobs/{id}/metrics; the events stream's metrics events carry none)",
    )
