"""The profile store's SQLAlchemy tables (``autotune/specs/profiles.py`` says what each holds and reads
them). Apart from that module so that importing it (the cost model does, for its constants) does not
import SQLAlchemy's ORM: only a search that reads or writes a profile needs these."""

from __future__ import annotations

from sqlalchemy import JSON, Boolean, Float, ForeignKey, Integer, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from autotune.specs.profile_schema import SCHEMA_VERSION


class Base(DeclarativeBase):
    pass


class ProfileRun(Base):
    __tablename__ = "autotune_profile_runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    label: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[str] = mapped_column(String(40))
    device_kind: Mapped[str] = mapped_column(String(20))
    device_name: Mapped[str] = mapped_column(String(200))
    nproc: Mapped[int] = mapped_column(Integer)
    quick: Mapped[bool] = mapped_column(Boolean, default=False)
    hosts: Mapped[list] = mapped_column(JSON)
    fingerprint: Mapped[dict] = mapped_column(JSON)
    versions: Mapped[dict] = mapped_column(JSON)
    emulated: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    """{rank: factor} when some rank emulated a slower device, else null."""
    measure_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    wall_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    unstable: Mapped[int] = mapped_column(Integer, default=0)
    origin: Mapped[str] = mapped_column(String(20), default="measured")
    """``measured`` (here) or ``imported``."""
    imported_from: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    schema_version: Mapped[int] = mapped_column(Integer, default=SCHEMA_VERSION)
    samples: Mapped[list[ProfileSample]] = relationship(back_populates="run", cascade="all, delete-orphan")
    fits: Mapped[list[ProfileFit]] = relationship(back_populates="run", cascade="all, delete-orphan")


class ProfileSample(Base):
    __tablename__ = "autotune_profile_samples"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("autotune_profile_runs.id", ondelete="CASCADE"), index=True)
    rank: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(40))
    params: Mapped[dict] = mapped_column(JSON)
    work: Mapped[float] = mapped_column(Float)
    median_s: Mapped[float] = mapped_column(Float)
    spread: Mapped[float] = mapped_column(Float)
    unstable: Mapped[bool] = mapped_column(Boolean)
    timing: Mapped[dict] = mapped_column(JSON)
    metrics: Mapped[dict] = mapped_column(JSON)
    run: Mapped[ProfileRun] = relationship(back_populates="samples")


class ProfileFit(Base):
    __tablename__ = "autotune_profile_fits"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("autotune_profile_runs.id", ondelete="CASCADE"), index=True)
    rank: Mapped[int | None] = mapped_column(Integer, nullable=True)
    """The rank for ``compute`` fits; null for ``links`` (a property of the whole run)."""
    kind: Mapped[str] = mapped_column(String(20))
    data: Mapped[dict] = mapped_column(JSON)
    run: Mapped[ProfileRun] = relationship(back_populates="fits")


class LayerProfileRow(Base):
    __tablename__ = "autotune_layer_profiles"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    label: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[str] = mapped_column(String(40))
    device_kind: Mapped[str] = mapped_column(String(20))
    device_name: Mapped[str] = mapped_column(String(200))
    model_name: Mapped[str] = mapped_column(String(200))
    model: Mapped[dict] = mapped_column(JSON)
    """The model shape the points are valid for (``profilers.layers.model_dict``)."""
    dtype: Mapped[str] = mapped_column(String(20))
    origin: Mapped[str] = mapped_column(String(20), default="measured")
    """``measured`` here, ``imported`` (an autotune export) or the foreign format it was read from."""
    source: Mapped[str] = mapped_column(String(500), default="")
    meta: Mapped[dict] = mapped_column(JSON)
    points: Mapped[list] = mapped_column(JSON)
    schema_version: Mapped[int] = mapped_column(Integer)
