"""Training data: image-caption datasets and video clips."""
