"""``make mlflow-ui``: MLflow's own tracking server and UI, opening as a model-training tool.

MLflow 3.17's UI chooses between its GenAI pages and its classic model-training pages by one
setting: the ``workflowType`` URL parameter, else the choice the browser stored when its user last
flipped the sidebar's "GenAI | Model training" switch (``localStorage["mlflow.workflowType_v1"]``,
a JSON string), else GenAI. A browser that never flipped it therefore lands on the GenAI welcome
page, opens an experiment on an empty traces overview and a run on evaluation tabs, whatever the
experiment's ``mlflow.experimentKind`` tag says (3.17 no longer reads it). No server option sets
that default.

This module is an MLflow app plugin (the ``mlflow.app`` entry point group, the mechanism MLflow's
own ``basic-auth`` app uses; ``mlflow ui --app-name bertqa-bench``): the same ASGI app
``mlflow ui`` serves, plus a few lines of script in the UI's index.html that run before the UI:

* a browser with no stored choice gets "Model training" stored, as if its user had flipped the
  switch once; a stored choice (either one) is left alone;
* opening an experiment's bare address (``#/experiments/<id>``, what one types or bookmarks) in
  model-training mode goes to the latest bench's view of that experiment, when it has one (the
  ``bertqa.latestView`` experiment tag written by tracking.py): the runs table with that bench
  expanded and its comparison columns. Other experiments and every other address are untouched.

Nothing else of MLflow's is changed: same routes, same store, same API.
"""
from __future__ import annotations

from flask import request
from mlflow.server import app as _flask_app
from mlflow.server.fastapi_app import app  # noqa: F401 - the ASGI app uvicorn serves, MLflow's own

from .tracking import LATEST_VIEW_TAG, VIEW_URL_PARAM, WORKFLOW

WORKFLOW_STORAGE_KEY = "mlflow.workflowType_v1"  # the UI's useLocalStorage key "mlflow.workflowType", version 1
MARKER = "bertqa-bench defaults"

SCRIPT = f"""<script>/* {MARKER}: see bertqa_bench/reporting/mlflow_ui.py */
(function () {{
  var stored = null;
  try {{
    stored = localStorage.getItem("{WORKFLOW_STORAGE_KEY}");
    if (stored === null) {{
      stored = JSON.stringify("machine_learning");
      localStorage.setItem("{WORKFLOW_STORAGE_KEY}", stored);
    }}
  }} catch (e) {{ return; }}
  if (stored !== JSON.stringify("machine_learning")) return;
  var m = location.hash.match(/^#\\/experiments\\/(\\d+)\\/?(?:runs\\/?)?$/);
  if (!m) return;
  var id = m[1];
  fetch("ajax-api/2.0/mlflow/experiments/get?experiment_id=" + id, {{credentials: "same-origin"}})
    .then(function (r) {{ return r.ok ? r.json() : null; }})
    .then(function (body) {{
      var tags = (body && body.experiment && body.experiment.tags) || [];
      var key = null;
      tags.forEach(function (t) {{ if (t.key === "{LATEST_VIEW_TAG}") key = t.value; }});
      if (!key) return;
      location.replace(location.pathname + location.search + "#/experiments/" + id +
                       "/runs?{VIEW_URL_PARAM}=" + encodeURIComponent(key) + "&{WORKFLOW}");
    }})
    .catch(function () {{}});
}})();
</script>"""


@_flask_app.after_request
def _ui_defaults(response):
    # Only the UI's page itself (served at the root, under --static-prefix if one is set).
    if response.status_code != 200 or response.mimetype != "text/html" or not request.path.endswith("/"):
        return response
    response.direct_passthrough = False  # send_from_directory streams the file; we need its text
    html = response.get_data(as_text=True)
    if MARKER in html or "<head>" not in html:
        return response
    response.set_data(html.replace("<head>", "<head>" + SCRIPT, 1))
    # The page changed: no validator that would let a browser keep MLflow's unmodified copy.
    for h in ("ETag", "Last-Modified"):
        response.headers.pop(h, None)
    response.headers["Cache-Control"] = "no-cache"
    return response
