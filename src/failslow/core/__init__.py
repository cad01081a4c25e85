"""Framework-agnostic core: records, tracking, profiling, validation, planning, control.

Never imports a training framework; imports torch only inside functions that need it.
"""
