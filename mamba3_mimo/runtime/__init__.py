"""Runtime machinery shared by every phase: device checks and the device guard (`device`), the
fast kernel launcher (`launcher`), call plans (`plans`) and shared-memory probes
(`resources`)."""
