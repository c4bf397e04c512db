//! API errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

use hyper::StatusCode;
use serde::Serialize;

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, `server_error`, ...
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

#[derive(Serialize)]
struct Body<'a> {
    error: Inner<'a>,
}

#[derive(Serialize)]
struct Inner<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
        }
    }

    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// 400 `invalid_request_error` about `param`.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message).with_param(param)
    }

    /// 400 `invalid_request_error` about the body as a whole.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub fn model_not_found(model: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("The model `{model}` does not exist."),
        )
        .with_param("model")
        .with_code("model_not_found")
    }

    pub fn payload_too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("The request body exceeds the limit of {limit} bytes."),
        )
    }

    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "Invalid or missing API key: send `Authorization: Bearer <key>`.",
        )
        .with_code("invalid_api_key")
    }

    pub fn engine_unavailable(detail: &str) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            format!("The engine core is unavailable: {detail}"),
        )
        .with_code("engine_unavailable")
    }

    pub fn draining() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "The server is shutting down.",
        )
        .with_code("shutting_down")
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    pub fn not_found_route(path: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("No route for {path}."),
        )
        .with_code("not_found")
    }

    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            format!("Method {method} is not allowed on {path}."),
        )
        .with_code("method_not_allowed")
    }

    /// The JSON body: `{"error": {...}}`.
    pub fn to_json(&self) -> String {
        let Self {
            status: _,
            message,
            kind,
            param,
            code,
        } = self;
        serde_json::to_string(&Body {
            error: Inner {
                message,
                kind,
                param: param.as_deref(),
                code: *code,
            },
        })
        .expect("error JSON")
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_shape() {
        let e = ApiError::invalid("temperature", "temperature must be >= 0");
        let v: serde_json::Value = serde_json::from_str(&e.to_json()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"error": {"message": "temperature must be >= 0", "type": "invalid_request_error", "param": "temperature", "code": null}})
        );
        let v: serde_json::Value =
            serde_json::from_str(&ApiError::model_not_found("x").to_json()).unwrap();
        assert_eq!(v["error"]["code"], "model_not_found");
    }
}
