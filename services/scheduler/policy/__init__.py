"""Scheduling: Req, SchedulePolicy, PrefillAdder, ScheduleBatch."""
