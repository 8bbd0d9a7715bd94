"""What the user watches: logs, top, watch, TensorBoard, and text as a terminal shows it."""
