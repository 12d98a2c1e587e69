"""The shared test harness: named meshes (meshes.py), models and the GPT plan factory
(models.py, hf_models.py), serial comparison (serial.py), communication counting (comm.py),
and the data-parallel training harness (data_parallel.py)."""
