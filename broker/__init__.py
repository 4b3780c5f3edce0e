"""The trajectory broker: schema, ZMQ broker process and its clients."""
