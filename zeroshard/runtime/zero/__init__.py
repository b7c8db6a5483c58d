"""DeepSpeed's module paths for its model-state memory estimators (``deepspeed.runtime.zero.stage_1_and_2`` and
``deepspeed.runtime.zero.stage3`` in compat mode); ``zeroshard.estimate`` predicts the whole peak."""
