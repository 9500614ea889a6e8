"""POST /classify (vLLM's route, classifiers: `...ForSequenceClassification` checkpoints):
each input's labels' probabilities, its pooled final hidden state (a decoder's last token,
an encoder's first, unless configured) through the model's score head
(`heron.core.pooling`).

``input`` is taken, truncated and checked as /v1/embeddings' is; all of a call's inputs run
in the same steps.
"""

from __future__ import annotations

from aiohttp import web

from heron.server.admission import check_model, check_queue_room
from heron.server.appkeys import ASYNC_ENGINE
from heron.server.embeddings import encoded_inputs, pool, require_task
from heron.server.errors import decode_body
from heron.server.protocol import ClassificationRequest
from heron.server.responses import Classification, ClassificationResponse, json_response


async def create_classification(request: web.Request) -> web.Response:
    app = request.app
    require_task(app, "/classify", "classify")
    req = await decode_body(request, ClassificationRequest)
    adapter = check_model(app, req.model)
    inputs = encoded_inputs(app, req, req.input, "input")[1]
    check_queue_room(app, inputs, "input")
    pooled = await pool(request, "classify", inputs, req.priority, adapter)
    labels = app[ASYNC_ENGINE].engine.pooler.pooling.labels
    data = [Classification(index=i, label=labels[int(p.argmax())], probs=p.tolist(),
                           num_classes=len(labels))
            for i, p in enumerate(pooled.vectors)]
    return json_response(ClassificationResponse(id=pooled.id, created=pooled.created,
                                                model=pooled.model, data=data,
                                                usage=pooled.usage))
