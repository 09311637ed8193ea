"""What an operator asks of the controller through the API: restart a run, rehearse an XID on one of its nodes,
attach a job of the backend's, cordon and uncordon a node, inject a fault (operators only). Bodies are validated
(pydantic) and a bad one is a 422 naming the field; opsd's errors are answered as HTTP statuses
(``opsd.api.answers.answer``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from opsd.api.answers import answer
from opsd.controller.controller import Controller
from opsd.controller.port import Fault, FaultKind
from opsd.controller.rows import RunRow
from opsd.protocol.records import IncidentRow, NodeRow
from opsd.protocol.states import NodeRole


class Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class CordonIn(Strict):
    reason: Annotated[str, Field(min_length=1, max_length=1000)]


class RestartIn(Strict):
    reason: Annotated[str, Field(min_length=1, max_length=1000)]


class DrillIn(Strict):
    node: Annotated[str, Field(min_length=1, max_length=253)]
    gpu: Annotated[int, Field(ge=0, le=1023)] = 0
    xid: Annotated[int, Field(ge=1, le=65535)] = 79


class AttachIn(Strict):
    target: Annotated[str, Field(min_length=1, max_length=600)]  # the job in the backend's words: NAMESPACE/JOBSET
    run: Annotated[str, Field(max_length=63)] = ""  # default: the backend's name for it (the JobSet's)


class InjectIn(Strict):
    fault: FaultKind
    node: Annotated[str, Field(max_length=200)] = ""
    gpu: Annotated[int, Field(ge=0)] = 0
    xid: Annotated[int, Field(ge=0)] = 79
    rank: Annotated[int, Field(ge=0)] = 0
    factor: Annotated[float, Field(gt=1, le=100)] = 1.3


def operations_router(controller: Controller, operators: Sequence[Any], clock: Callable[[], float]) -> APIRouter:
    """The operators' requests; ``operators``: the dependencies that let operators alone through."""
    router = APIRouter()

    @router.post("/v1/runs/attach", dependencies=operators)
    def attach(body: AttachIn) -> RunRow:
        """Make a job of the backend's a run (a JobSet without the ``opsd.io/run`` annotation); answers the run."""
        return answer(lambda: controller.attach_run(body.target, body.run, clock()))

    @router.post("/v1/runs/{run}/restart", dependencies=operators)
    def restart(run: str, body: RestartIn) -> IncidentRow:
        """Restart every rank of a running run: a checkpoint first when the ranks progress; answers the incident
        that records it (poll ``/v1/runs/{run}/incidents`` for its end)."""
        return answer(lambda: controller.request_restart(run, body.reason, clock()))

    @router.post("/v1/runs/{run}/drill", dependencies=operators)
    def drill(run: str, body: DrillIn) -> IncidentRow:
        """Rehearse a fatal XID on one of a running run's nodes: an incident recovered from as a real XID's (the
        node quarantined, a spare taken, the run relaunched), its detail saying it is a drill."""
        return answer(lambda: controller.drill_xid(run, body.node, body.gpu, body.xid, clock()))

    @router.post("/v1/nodes/{node}/cordon", dependencies=operators)
    def cordon(node: str, body: CordonIn) -> NodeRow:
        return answer(lambda: controller.set_node_role(node, NodeRole.CORDONED, body.reason, clock()))

    @router.post("/v1/nodes/{node}/uncordon", dependencies=operators)
    def uncordon(node: str) -> NodeRow:
        return answer(lambda: controller.set_node_role(node, NodeRole.SPARE, "", clock()))

    @router.post("/v1/runs/{run}/inject", dependencies=operators)
    def inject(run: str, body: InjectIn) -> dict[str, str]:
        fault = Fault(body.fault, node=body.node, gpu=body.gpu, xid=body.xid, rank=body.rank, factor=body.factor)
        return {"injected": answer(lambda: controller.inject(run, fault))}

    return router
