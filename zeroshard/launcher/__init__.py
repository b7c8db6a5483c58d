"""The ``zeroshard`` command-line launcher."""
