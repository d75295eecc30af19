"""What runs on the device side of the step boundary: draft verification and the draft proposers."""
