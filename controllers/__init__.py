"""The controller: one Ray actor that turns workers' statistics into compression plans."""
