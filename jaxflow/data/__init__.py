"""The data services and the records that cross between the pieces.

records.py (Sample, GroupTask, FinishedGroup, ConsumedBatch), prompt_source.py (prompts through grain),
trajectory_service.py (Reserve -> Occupy -> Consume; its named errors in service_errors.py), param_service.py
and its storage param_storage.py (versioned HF-named weights), device_params.py (versioned weights kept on
device, for JAX engines in the trainer's process) and reshard.py (the compiled move of a version between
layouts, `reshard_program`). Nothing here imports the transport: `jaxflow.transport`
registers these types.
"""
