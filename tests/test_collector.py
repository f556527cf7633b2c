"""Python's garbage collector while a `python train.py` run starts (gptlab.tasks.collector): the objects that
survive a full collection are frozen until the task's loop begins, and handed back to the collector when the run
ends; nothing still referenced is released, and a cycle that became garbage meanwhile is collected after."""

from __future__ import annotations

import gc
import weakref

import pytest

from gptlab.tasks.collector import freezing_while_starting, startup_over


class Node:
    """A cycle of one: only the cyclic collector can release it."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def unfrozen():
    """A collector as a fresh process has it: on, nothing frozen (an earlier test's freeze handed back, which
    changes no value), as it was left afterwards."""
    enabled = gc.isenabled()
    gc.enable()
    gc.unfreeze()
    yield
    gc.unfreeze()
    if not enabled:
        gc.disable()


def test_survivors_of_start_up_collections_are_frozen_until_the_loop_and_handed_back_at_the_end(unfrozen):
    with freezing_while_starting():
        started = Node()
        gc.collect()  # a full collection: its survivors are frozen
        assert gc.get_freeze_count() > 0
        started_ref = weakref.ref(started)
        del started
        gc.collect()
        assert started_ref() is not None  # garbage while frozen: it waits for the run's end
        startup_over()
        frozen = gc.get_freeze_count()
        looping = Node()
        gc.collect()
        # the loop's objects are the default collector's: nothing more is frozen (the count may fall: a frozen
        # object that another test's thread releases meanwhile leaves the frozen generation), and the loop's
        # garbage is collected, below
        assert gc.get_freeze_count() <= frozen
        looping_ref = weakref.ref(looping)
        del looping
        gc.collect()
        assert looping_ref() is None
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert started_ref() is None  # handed back: collected as any garbage


def test_the_end_of_a_run_that_raised_hands_everything_back(unfrozen):
    with pytest.raises(RuntimeError), freezing_while_starting():
        gc.collect()
        raise RuntimeError("the task failed while starting")
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert gc.get_freeze_count() == 0  # nothing freezes after the run


def test_a_process_that_froze_objects_itself_is_left_alone(unfrozen):
    gc.freeze()  # as a process does before forking its workers
    frozen = gc.get_freeze_count()
    with freezing_while_starting():
        Node()
        gc.collect()
        assert gc.get_freeze_count() == frozen
    assert gc.get_freeze_count() == frozen  # not handed back by gptlab: it was not gptlab's
