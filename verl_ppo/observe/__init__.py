"""What a run reports: the phase metrics (:mod:`.metrics`), trackers (:mod:`.tracking`),
the Prometheus endpoint (:mod:`.monitor`), the step line (:mod:`.report`) and MFU
(:mod:`.perf`)."""
