"""The scheduling modes of `[orchestrator.scheduler] mode`, one module each (arbor.registry.MODES lists them).

Adding a scheduling mode = one new file + one line in arbor/registry.py: the file holds a class built as
`Mode(settings: ModeSettings)` that implements arbor.orchestrator.scheduler.SchedulingMode (`continuous`,
`window`, `slack`, `max_in_flight`, `most_in_flight`, `queue_budget`, `lag(step)`, `admits(...)`, `pick(ready)`),
usually by subclassing `PerStepMode` or `ContinuousMode` of arbor.orchestrator.modes.base; the line registers it
under MODES by name. A mode kept outside arbor needs no line: `mode = "package.module:Class"`.
"""
