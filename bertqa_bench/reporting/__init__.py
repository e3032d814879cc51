"""The reporting stage: what happens to measurements once they exist. Result bundles on disk, the
Markdown/plot reports built from them, MLflow tracking and its UI plugin, the parity gate's verdict
table, LoadGen result summaries and the scaling reference tables."""
