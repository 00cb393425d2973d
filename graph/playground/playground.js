// kami's GraphQL playground: GraphiQL on kami's own /graphql, with
// subscriptions over the WebSocket on the same path. Everything it loads
// comes from kami itself (see playground.go); it asks nothing of any other
// host.
(function () {
  'use strict';
  var config = JSON.parse(document.getElementById('kami-playground').textContent);
  var http = new URL(config.endpoint, window.location.href);
  var ws = new URL(http.href);
  ws.protocol = http.protocol === 'https:' ? 'wss:' : 'ws:';

  var props = {
    fetcher: GraphiQL.createFetcher({ url: http.href, subscriptionUrl: ws.href }),
    defaultEditorToolsVisibility: true,
    // A browser that has used the playground before opens its own tabs;
    // a new one opens the walk-through.
    defaultTabs: [{ query: config.example, variables: config.exampleVariables }],
  };
  if (!storedTabs()) {
    // GraphiQL fills the variables editor from its props or its storage,
    // not from defaultTabs: give the walk-through's on the first visit.
    props.variables = config.exampleVariables;
  }
  // /?orderNo=… (the sandbox pay page links here when the shop has no
  // storefront of its own) opens that order's query.
  var orderNo = new URLSearchParams(window.location.search).get('orderNo');
  if (orderNo) {
    props.query = config.orderQuery;
    props.variables = JSON.stringify({ orderNo: orderNo, accessToken: 'the accessToken createOrder returned' }, null, 2);
  }
  function storedTabs() {
    try {
      return window.localStorage.getItem('graphiql:tabState') !== null;
    } catch (e) {
      return false; // storage refused (private mode): GraphiQL keeps nothing either
    }
  }

  ReactDOM.createRoot(document.getElementById('graphiql')).render(React.createElement(GraphiQL, props));
})();
