"""SGLang: its server process, the fleet's generation client and the learner's weight client over one server-control base, fleetrl's loader inside SGLang's workers, LoRA, the fleet's factory."""
