"""Scheduling policy: SchedulePolicy (request order) and PrefillAdder (what fits in one prefill)."""
