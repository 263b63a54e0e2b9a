"""kmp.schedules: learning-rate and momentum schedules (DeepSpeed's scheduler block).

    formulas.py  the schedules as pure Python: parsing and the rate at a step (no TensorFlow)
    keras.py     the same formulas as Keras LearningRateSchedules
    momentum.py  one-cycle momentum on a Keras optimizer's beta_1

formulas.py imports only kmp.errors and kmp.values, so kmp.config and
`kmp config check` use it without TensorFlow; keras.py and momentum.py import
Keras. This file imports nothing.
"""
