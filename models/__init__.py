"""Models and their data. Each builds a Keras model; none knows about compression."""
