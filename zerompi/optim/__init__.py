"""The optimizer over fp32 shards (one step path whatever is offloaded) and fp16 loss scaling."""
