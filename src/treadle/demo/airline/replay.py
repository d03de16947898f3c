"""Replaying recorded airline conversations through treadle, with real crashes, and reporting.

`replay_recordings` serves the recordings from a `ReplayServer` in this process and drives
each one's run (``airline-<task>-<trial>``) in a child process
(``python -m treadle.demo.airline.driver``), several at a time. With crashes, the first child
of a run SIGKILLs itself at a store write chosen from the seed (`crash_point`); a new child
then resumes the run from the log. Once the run has finished, it is scored and compared with
the recording (`ReplayReport`).

Everything a replay keeps lives next to the run store, in a `Workspace`: the fresh airline
database, one database per conversation, each run's crash and resume counts and the history
mismatches the server saw. Running again with the same store resumes unfinished runs and
reports finished ones without running them again.

`run_live` runs the same agent definition against a real endpoint, with a person as the
customer.

The code lives in private modules by responsibility: `_discovery` (the workload and its
recordings), `_crash_points`, `_workspace`, `_report` (scoring and comparing), `_drivers`
(the child processes and the orchestration) and `_live` (live mode).
"""

from __future__ import annotations

from treadle.demo._defaults import DEFAULT_CONCURRENCY as DEFAULT_CONCURRENCY
from treadle.demo.airline._crash_points import CrashMode as CrashMode
from treadle.demo.airline._crash_points import CrashPoint as CrashPoint
from treadle.demo.airline._crash_points import crash_point as crash_point
from treadle.demo.airline._crash_points import demo_crash_point as demo_crash_point
from treadle.demo.airline._crash_points import first_change_step as first_change_step
from treadle.demo.airline._discovery import DEMO_RECORDING as DEMO_RECORDING
from treadle.demo.airline._discovery import RUN_ID_PREFIX as RUN_ID_PREFIX
from treadle.demo.airline._discovery import default_cache_dir as default_cache_dir
from treadle.demo.airline._discovery import expected_writes as expected_writes
from treadle.demo.airline._discovery import find_recording as find_recording
from treadle.demo.airline._discovery import load_trajectories as load_trajectories
from treadle.demo.airline._discovery import locate_workload as locate_workload
from treadle.demo.airline._discovery import pick_demo_recording as pick_demo_recording
from treadle.demo.airline._discovery import recorded_steps as recorded_steps
from treadle.demo.airline._discovery import run_id_of as run_id_of
from treadle.demo.airline._drivers import MAX_CHILDREN as MAX_CHILDREN
from treadle.demo.airline._drivers import STDERR_TAIL_BYTES as STDERR_TAIL_BYTES
from treadle.demo.airline._drivers import ChildExit as ChildExit
from treadle.demo.airline._drivers import ReplayObserver as ReplayObserver
from treadle.demo.airline._drivers import replay_recordings as replay_recordings
from treadle.demo.airline._drivers import spawn_driver as spawn_driver
from treadle.demo.airline._live import LiveReport as LiveReport
from treadle.demo.airline._live import LiveShow as LiveShow
from treadle.demo.airline._live import live_run_id as live_run_id
from treadle.demo.airline._live import policy_text as policy_text
from treadle.demo.airline._live import run_live as run_live
from treadle.demo.airline._live import tasks_by_id as tasks_by_id
from treadle.demo.airline._report import ReplayReport as ReplayReport
from treadle.demo.airline._report import agent_replies as agent_replies
from treadle.demo.airline._report import build_report as build_report
from treadle.demo.airline._report import expected_for as expected_for
from treadle.demo.airline._report import failed_report as failed_report
from treadle.demo.airline._workspace import RunCounts as RunCounts
from treadle.demo.airline._workspace import Workspace as Workspace
from treadle.demo.airline._workspace import open_workspace as open_workspace

__all__ = [
    "DEFAULT_CONCURRENCY",
    "DEMO_RECORDING",
    "MAX_CHILDREN",
    "RUN_ID_PREFIX",
    "STDERR_TAIL_BYTES",
    "ChildExit",
    "CrashMode",
    "CrashPoint",
    "LiveReport",
    "LiveShow",
    "ReplayObserver",
    "ReplayReport",
    "RunCounts",
    "Workspace",
    "agent_replies",
    "build_report",
    "crash_point",
    "default_cache_dir",
    "demo_crash_point",
    "expected_for",
    "expected_writes",
    "failed_report",
    "find_recording",
    "first_change_step",
    "live_run_id",
    "load_trajectories",
    "locate_workload",
    "open_workspace",
    "pick_demo_recording",
    "policy_text",
    "recorded_steps",
    "replay_recordings",
    "run_id_of",
    "run_live",
    "spawn_driver",
    "tasks_by_id",
]
